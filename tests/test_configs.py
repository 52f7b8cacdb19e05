"""Tile heuristics, forced configurations and the opt-in autotuning's selection."""

import dataclasses
import warnings

import pytest
import torch

from fusedmaxsim import _plan, forced_plan, maxsim, settings
from fusedmaxsim._launch.forward import _tuned as tuned
from fusedmaxsim._plan import MEASURED, FwdConfig, fwd_candidates, fwd_heuristic, plan_forward
from fusedmaxsim._problem import CROSS, Problem, dense_problem, options_for
from fusedmaxsim.planning import recording
from fusedmaxsim.reference import maxsim_ref


def _fwd_config(Lq, dim, Nq, per_query_docs, elem_bytes):
    """The forward's default tiles for these sizes on this machine (the interpreter's here)."""
    return fwd_heuristic(Lq, dim, Nq, per_query_docs, elem_bytes)


def _call_tiles(cfg, normalize, Nq, Lq, Ncols, Ld, sms):
    """The Gluon forward the planner gives an inference cross product of these sizes (16-bit, d
    of the tiles) on a device of ``sms`` SMs, with the forward tiles ``cfg``: (tile set, queries
    a block once padded, chunk splits, documents a program). The Gluon forward is forced so that
    its tiles are planned on this CPU too (its applicability is tested apart)."""
    p = Problem(CROSS, Nq, Ncols, Lq, Ld, cfg.block_k, torch.bfloat16, torch.device("cpu"),
                False, False, normalize, normalize, 0.0, False, True)
    o = options_for(torch.empty(0, dtype=torch.bfloat16), backend="triton")
    with forced_plan(kernel="gluon", fwd_tiles=cfg, sm_count=sms):
        plan = plan_forward(p, o)
    assert plan.kernel == "gluon"
    hopper = plan.hopper
    return hopper.tiles, hopper.queries_per_block, plan.splits, hopper.docs_per_program


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
    base = _fwd_config(Lq=32, dim=128, Nq=64, per_query_docs=False, elem_bytes=2)
    candidates = fwd_candidates(base)
    assert candidates[0] == base and len(candidates) == len(set(candidates)) >= 2


def test_every_candidate_computes_the_same_scores(device):
    Q = torch.randn(5, 7, 32, device=device)
    D = torch.randn(4, 37, 32, device=device)
    ref = maxsim_ref(Q.double(), D.double()).float()
    base = FwdConfig(16, 4, 32, 32, 4, 1)
    with settings.use_backend("triton"):
        for cfg in fwd_candidates(base):
            with forced_plan(fwd_tiles=cfg):
                torch.testing.assert_close(maxsim(Q, D), ref, rtol=1e-5, atol=1e-5)


def test_exact_ties_setting():
    """Off by default; the scoped manager restores what was there; while on, the Gluon training
    forward never applies (the planner sends the argmax-saving forward to Triton even where the
    Gluon forward is forced, on documents of 16 tiles of 64 tokens, which its codes hold)."""

    def training_kernel():
        Q = torch.empty(4, 128, 128, dtype=torch.bfloat16)
        D = torch.empty(8, 1024, 128, dtype=torch.bfloat16)
        p = dense_problem(Q, D, None, None, save_argmax=True)
        with forced_plan(kernel="gluon", hopper_tiles=MEASURED["HOPPER_TILES"]):
            return plan_forward(p, options_for(Q, backend="triton")).kernel

    assert settings.exact_ties() is False
    assert training_kernel() == "gluon"
    with settings.use_exact_ties():
        assert settings.exact_ties() is True
        assert training_kernel() == "triton"
        with settings.use_exact_ties(False):
            assert settings.exact_ties() is False
        assert settings.exact_ties() is True
    assert settings.exact_ties() is False


@pytest.mark.parametrize("name,env", [("autotune", "FUSEDMAXSIM_AUTOTUNE"),
                                      ("exact_ties", "FUSEDMAXSIM_EXACT_TIES")])
def test_boolean_setting(monkeypatch, name, env):
    """Off by default, on through its setter or its environment variable, back with ``None``."""
    getter, setter = getattr(settings, name), getattr(settings, f"set_{name}")
    assert getter() is False
    setter(True)
    assert getter() is True
    setter(None)
    monkeypatch.setenv(env, "1")
    settings.reload()
    try:
        assert getter() is True
    finally:
        monkeypatch.delenv(env)
        settings.reload()
    assert getter() is False


@pytest.mark.parametrize("Lq,bucket", [(1, 16), (7, 16), (32, 32), (33, 64), (100, 128), (1030, 2048)])
def test_query_tiles_bucket_lengths(Lq, bucket):
    """One compiled kernel per power-of-two bucket, capped at the tile height (32 rows in the
    interpreter, 128 on a GPU at this d): longer queries loop over chunks of the same kernel."""
    cap = 32 if settings.INTERPRETER else 128
    cfg = _fwd_config(Lq=Lq, dim=64, Nq=3, per_query_docs=False, elem_bytes=4)
    assert cfg.lq_tile == min(bucket, cap)
    assert cfg == _fwd_config(Lq=bucket, dim=64, Nq=3, per_query_docs=False, elem_bytes=4)


def _gpu_default(Lq=32, Nq=64, per_query_docs=False):
    return fwd_heuristic(Lq, 128, Nq, per_query_docs, 2, interp=False)


def test_few_programs_take_two_warp_groups_with_64_token_tiles():
    base = _gpu_default()
    cfg = _plan.fwd_variant(base, few_programs=True, save_argmax=True, norm_from_tiles=False,
                               per_query_docs=False, elem_bytes=2)
    assert (cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.max_registers) == (64, 8, 4, None)
    assert (cfg.lq_tile, cfg.queries_per_block) == (base.lq_tile, base.queries_per_block)


SPILL_FREE_8_WARPS = (32, 8, 4, 128, False)
QUERY_IN_REGISTERS = (32, 4, 3, None, True)


@pytest.mark.parametrize("Lq,Nq,save_argmax,norm_from_tiles,per_query_docs,tiles", [
    (128, 64, True, False, False, QUERY_IN_REGISTERS),  # training forward of the cross product
    (32, 64, True, False, False, QUERY_IN_REGISTERS),  # the same, short queries packed by four
    (32, 64, False, False, False, QUERY_IN_REGISTERS),  # inference on packed short queries
    (32, 1, True, False, False, SPILL_FREE_8_WARPS),  # 32 rows: no warp-group product
    (128, 64, False, True, False, SPILL_FREE_8_WARPS),  # inference normalizing from the tiles
    (128, 64, False, False, False, None),  # inference on 128-row queries keeps the default
    (128, 64, True, False, True, None),  # per-query candidates keep the default (measured slower)
])
def test_tiles_where_the_default_spills_or_waits_on_shared_memory(
    Lq, Nq, save_argmax, norm_from_tiles, per_query_docs, tiles
):
    base = _gpu_default(Lq=Lq, Nq=Nq, per_query_docs=per_query_docs)
    cfg = _plan.fwd_variant(base, few_programs=False, save_argmax=save_argmax,
                               norm_from_tiles=norm_from_tiles, per_query_docs=per_query_docs,
                               elem_bytes=2)
    if tiles is None:
        assert cfg == base
    else:
        assert (cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.max_registers,
                cfg.query_in_registers) == tiles
        assert (cfg.lq_tile, cfg.queries_per_block) == (base.lq_tile, base.queries_per_block)


def test_variants_only_for_the_measured_inputs():
    for base, elem_bytes in ((fwd_heuristic(32, 128, 64, False, 4, interp=False), 4),
                             (fwd_heuristic(32, 320, 64, False, 2, interp=False), 2)):
        for few in (True, False):
            assert _plan.fwd_variant(base, few_programs=few, save_argmax=True, norm_from_tiles=True,
                                     per_query_docs=False, elem_bytes=elem_bytes) == base


def test_autotune_candidates_keep_the_register_cap_only_with_its_own_tiles():
    base = dataclasses.replace(_gpu_default(), num_warps=8, max_registers=128, query_in_registers=True)
    for cfg in fwd_candidates(base):
        if cfg.max_registers is not None or cfg.query_in_registers:
            assert (cfg.block_n, cfg.num_warps, cfg.num_stages) == (base.block_n, 8, base.num_stages)


def test_measured_tile_variants_only_on_hopper():
    assert not _plan.measured_tiles(torch.device("cpu"))
    if torch.cuda.is_available():
        major = torch.cuda.get_device_capability()[0]
        assert _plan.measured_tiles(torch.device("cuda")) == (torch.version.hip is None and major == 9)


def test_the_gluon_forward_never_applies_off_a_gpu():
    """The Hopper kernel's gate: CPU tensors (and so every interpreter run) take the Triton or
    PyTorch path, whatever the shape (the least work it takes forced to 0 here)."""
    Q = torch.randn(4, 32, 128, dtype=torch.bfloat16)
    D = torch.randn(8, 300, 128, dtype=torch.bfloat16)
    for save_argmax in (False, True):
        p = dense_problem(Q, D, None, None, save_argmax=save_argmax)
        with forced_plan(HOPPER_MIN_MACS=0):
            plan = plan_forward(p, options_for(Q, backend="triton"))
            assert plan_forward(p, options_for(Q, backend="torch")).kernel == "torch"
        assert plan.kernel == "triton" and plan.hopper is None
        assert any("not an NVIDIA Hopper GPU" in reason for reason in plan.reasons), plan.reasons
    with torch.no_grad(), recording() as plans:
        maxsim(Q, D)
    assert [plan.kernel for _, plan in plans] == ["torch"]  # bf16 on a CPU: the PyTorch path


def test_a_failing_gluon_forward_falls_back_to_triton(device):
    """Where the Gluon forward cannot be built (an experimental API that moves between Triton
    releases), the call warns once and gets the Triton kernel's scores; later calls go straight
    to Triton. Forced onto CPU tensors, the Gluon launch fails for real."""
    if torch.cuda.is_available():
        pytest.skip("the Gluon launch fails for real only on CPU tensors (the interpreter); "
                    "on a GPU it may build and run")
    Q, D = torch.randn(3, 7, 16, device=device), torch.randn(4, 13, 16, device=device)
    settings.set_hopper_kernel(True)
    try:
        with settings.use_backend("triton"), settings.use_fp32_precision("ieee"), torch.no_grad():
            with (
                forced_plan(kernel="gluon"),
                recording() as plans,
                pytest.warns(RuntimeWarning, match=r"the Hopper \(Gluon\) forward failed"),
            ):
                first = maxsim(Q, D)
            assert [plan.kernel for _, plan in plans] == ["gluon"]
            assert settings.hopper_kernel() is False
            with warnings.catch_warnings(), recording() as plans:
                warnings.simplefilter("error")  # no second warning
                second = maxsim(Q, D)
            (_, plan), = plans
            assert plan.kernel == "triton"
            assert any("Hopper kernel is off" in reason for reason in plan.reasons), plan.reasons
    finally:
        settings.set_hopper_kernel(None)
    want = maxsim_ref(Q.double(), D.double()).float()
    torch.testing.assert_close(first, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(second, first)


def test_a_short_query_block_is_padded_to_the_warp_group_rows():
    """The Gluon forward takes blocks of 64 or 128 query rows: a single 32- or 16-token query is
    padded with empty query slots to 64 rows; blocks of 64 rows or more stay as they are."""
    for Lq, Nq in ((32, 1), (16, 1), (128, 1), (32, 64)):
        cfg = _fwd_config(Lq=Lq, dim=128, Nq=Nq, per_query_docs=False, elem_bytes=2)
        block = _plan.hopper_block(cfg)
        rows = block.lq_tile * block.queries_per_block
        assert rows == max(64, cfg.lq_tile * cfg.queries_per_block)
        assert block.lq_tile == cfg.lq_tile
        # Equal, not identical: the cache may hand back an equal configuration built earlier.
        assert (block == cfg) == (cfg.lq_tile * cfg.queries_per_block >= 64)


def test_the_gluon_descriptor_from_a_template_equals_the_constructed_one():
    """The launcher builds the documents' TMA descriptor from a cached template without the
    constructor's checks: every field equal to the one the constructor builds."""
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from fusedmaxsim._launch import forward

    layout = forward.gluon_layouts(torch.bfloat16, 64, 32, 128)[1]
    template = forward._descriptor_template(torch.bfloat16, 32, 128, layout)
    if template is None:
        pytest.skip("this Triton's descriptor is not a plain dataclass: the constructor serves")
    documents = torch.randn(7 * 300, 128, dtype=torch.bfloat16)
    built = forward._tensor_descriptor(template, documents, [7 * 300, 128], [128, 1])
    want = TensorDescriptor(documents, [7 * 300, 128], [128, 1], [32, 128], layout)
    assert type(built) is type(want)
    assert built.__dict__.keys() == want.__dict__.keys()
    for name, value in want.__dict__.items():
        assert getattr(built, name) is value if name == "base" else getattr(built, name) == value


def test_hopper_tiles_follow_the_grid():
    """The dispatch's tiles: two warp groups a program only for 128-row blocks on grids of at
    most one program an SM; the normalized short queries' 32-token tiles only on larger grids."""
    long_query = FwdConfig(128, 1, 64, 128, 4, 3)
    packed = FwdConfig(32, 4, 64, 128, 4, 3)
    short = FwdConfig(32, 1, 64, 128, 4, 3)
    assert _plan.hopper_tiles(long_query, False, 132, 132) == MEASURED["HOPPER_FEW_PROGRAMS_TILES"]
    assert _plan.hopper_tiles(packed, True, 100, 132) == MEASURED["HOPPER_FEW_PROGRAMS_TILES"]
    assert _plan.hopper_tiles(long_query, False, 133, 132) == MEASURED["HOPPER_TILES"]
    assert _plan.hopper_tiles(long_query, True, 1000, 132) == MEASURED["HOPPER_NORM_TILES"]
    assert _plan.hopper_tiles(packed, False, 1000, 132) == MEASURED["HOPPER_PACKED_TILES"]
    assert _plan.hopper_tiles(packed, True, 1000, 132) == MEASURED["HOPPER_SHORT_NORM_TILES"]
    assert _plan.hopper_tiles(short, True, 1000, 132) == MEASURED["HOPPER_SHORT_NORM_TILES"]
    assert _plan.hopper_tiles(short, True, 100, 132) == MEASURED["HOPPER_NORM_TILES"]
    assert _plan.hopper_tiles(short, False, 100, 132) == MEASURED["HOPPER_SHORT_TILES"]
    # A call's grid: longdoc's 16 packed 32-token queries against 32 documents, 4 blocks × 32
    # documents = 128 programs; one short query padded to two slots against 133 documents.
    assert _call_tiles(packed, False, 16, 32, 32, 8192, 132) == (
        MEASURED["HOPPER_FEW_PROGRAMS_TILES"], 4, 1, 1)
    assert _call_tiles(packed, False, 16, 32, 34, 8192, 132) == (
        MEASURED["HOPPER_PACKED_TILES"], 4, 1, 1)
    assert _call_tiles(short, True, 1, 32, 133, 300, 132) == (
        MEASURED["HOPPER_SHORT_NORM_TILES"], 2, 1, 1)


def test_hopper_documents_a_program_follow_the_grid():
    """Several documents a program where one query chunk meets documents of at least a ring of
    tiles, at most 128 tiles a program and a program an SM: the most for short documents; for
    long ones, one unless that grid makes two waves, then one wave; for the normalizing
    forward, the fewest waves counted in documents plus a start."""
    long_query = FwdConfig(128, 1, 64, 128, 4, 3)
    packed = FwdConfig(32, 4, 64, 128, 4, 3)
    short = FwdConfig(32, 1, 64, 128, 4, 3)

    def docs(cfg, normalize, Nq, Lq, Ncols, Ld):
        return _call_tiles(cfg, normalize, Nq, Lq, Ncols, Ld, 132)[3]

    # batch_colbert: 64 blocks × 256 documents of five 64-token tiles: 16 (80 tiles a program).
    assert docs(packed, False, 256, 32, 256, 300) == 16
    # A short query against 2000 documents of ten 32-token tiles: 8 (250 programs); 1000: 4.
    assert docs(short, False, 1, 32, 2000, 300) == 8
    # rerank_colbert: a padded short query, ten 32-token tiles a document (6 stages) → 4.
    assert docs(short, False, 1, 32, 1000, 300) == 4
    assert docs(long_query, False, 1, 128, 1000, 960) == 4  # 15 tiles: 60 a program
    # Plain, 16 tiles a document, two programs an SM (264 slots): one, but where one a program
    # makes two waves (265-528 documents), the count that makes one: 300, 400 and 500 → 150, 200
    # and 250 programs at two. rerank_colpali (1000 / 264 = 3.79 waves), 530, 3000 documents and
    # train_colpali's shape: one; 264 is one wave already.
    for Ncols, expected in ((1000, 1), (3000, 1), (530, 1), (800, 1), (264, 1), (150, 1),
                            (300, 2), (400, 2), (500, 2)):
        assert docs(long_query, False, 1, 128, Ncols, 1024) == expected, Ncols
    assert docs(long_query, False, 128, 128, 128, 1024) == 1
    # A padded short query's 32-token tiles run three programs an SM (396 slots): 300 documents of
    # 1024 are one wave (one); 400 and 530 two (two a program); 800 three (one).
    for Ncols, expected in ((300, 1), (400, 2), (530, 2), (800, 1)):
        assert docs(short, False, 1, 32, Ncols, 1024) == expected, Ncols
    # Normalizing: waves of (documents + 0.3) document-times. rerank_colpali_norm: 4 waves of
    # 1.3 at one, 2 of 2.3 at two, 1 of 4.3 at four (8: 125 programs < 132 SMs).
    for Ncols, expected in ((1000, 4), (300, 2), (530, 1), (200, 1)):
        assert docs(long_query, True, 1, 128, Ncols, 1024) == expected, Ncols
    # Normalized short queries (32-token tiles, four programs an SM): 300 → 1, 1000 → 2,
    # 3000 → 2 (six waves of 1.3, three of 2.3, two of 4.3, one of 8.3 at 375 programs: 2);
    # batch_colbert normalized (64 blocks × 256 documents): 8, four waves of 8.3 against eight
    # of 4.3.
    for Ncols, expected in ((300, 1), (1000, 2), (3000, 2)):
        assert docs(short, True, 1, 32, Ncols, 300) == expected, Ncols
    assert docs(packed, True, 256, 32, 256, 300) == 8
    # Several query chunks, or documents shorter than the ring: one.
    assert docs(long_query, False, 4, 2048, 64, 1024) == 1
    assert docs(packed, False, 256, 32, 256, 100) == 1
    # Forced (tests, probes) where it applies, and not where it does not.
    with forced_plan(docs_per_program=3):
        assert docs(long_query, False, 1, 128, 200, 1024) == 3
        assert docs(long_query, False, 4, 2048, 64, 1024) == 1
    # The planner's composition is the policy function's, on explicit numbers.
    assert _plan.hopper_docs_per_program(MEASURED["HOPPER_TILES"], 128, 128, 1024, 300, 1, 132,
                                         False) == 2
