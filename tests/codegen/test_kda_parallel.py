"""The single-chunk parallel KDA forward (codegen/kda_parallel.py + templates/kda_parallel.py.jinja)
against the float64 token recurrence (patterns/kda_reference.py).

On CPU the kernels run in Triton's interpreter at small, ragged sizes (T, K, V not multiples of the
blocks nor powers of two; K = 300 spans several key blocks and split-K partials); tests marked
``gpu`` run the compiled kernels, among them the short-sequence, large-state shapes the kernels are
for. Every output is allocated poisoned (NaN), so an element a kernel fails to write shows up.
"""

from __future__ import annotations

import pytest
from _kernel_checks import CPU, check_kda_bad_out, check_kda_forward, check_kda_lead_forward, check_kda_out, compiled_keys
from _kernel_checks import check_kda_out_no_tokens
from _kernel_checks import kda_eager_loop, kda_strided_views, rel_err
from _kernel_checks import KDA_TOL as TOL
from _kernel_checks import kda_inputs as _inputs
from _kernel_checks import kda_reference_rows as _reference
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuser.codegen import kda_parallel as kp
from fuser.codegen import launch

DOT = {"STATE_DOT": True}                              # the final state by one tl.dot
NO_REDUCE = {"REDUCE_OVER": 1 << 30}                   # every solve program sums the Gram partials
FEW_SPLITS = {"GRAM_STEPS": 64}                        # one Gram program per row
TILES = {"V_TILES": 3, "BLOCK_V": 16}                  # three value tiles per state program (ragged: V=40)
DOT_TILES = {"STATE_DOT": True, "V_TILES": 2, "BLOCK_V": 16}
DK = {"GRAM_DK": True}                                 # the Gram tiles channel-major
FUSED = {"FUSED": True, "BLOCK_KF": 16, "BLOCK_VF": 16}  # one launch (T <= 16); ragged key blocks


def _check(*args, **kwargs):
    """The launcher against the float64 reference (``_kernel_checks.check_kda_forward``)."""
    return check_kda_forward(kp.forward, *args, **kwargs)


# --------------------------------------------------------------------------------------------
# CPU (interpreter)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("t,kd,vd", [(1, 24, 70), (5, 24, 40), (8, 300, 70), (37, 24, 40)])
@pytest.mark.parametrize("h0", [False, True], ids=["zeros", "h0"])
def test_matches_reference(t, kd, vd, h0):
    # grouped value heads (2); K=300: five Gram key blocks in three split-K programs, 19 projection
    # key blocks; V=70, 40: ragged value blocks; T=37: 64-padded tiles, the Gram partials reduced by
    # their own launch
    q, k, v, g, beta, s0 = _inputs(1, 1, 2, t, kd, vd, h0=h0)
    _check(q, k, v, g, beta, s0)


@pytest.mark.parametrize("t", [8, 37])
def test_float16(t):
    q, k, v, g, beta, h0 = _inputs(2, 1, 2, t, 24, 40, dtype=torch.float16, h0=True)
    _check(q, k, v, g, beta, h0)


@pytest.mark.parametrize("t,kd", [(8, 24), (5, 300)])
@pytest.mark.parametrize("config", [None, DK], ids=["default", "gram_dk"])
def test_scalar_gate(t, kd, config):
    q, k, v, g, beta, h0 = _inputs(3, 2, 1, t, kd, 40, scalar_gate=True, h0=True)
    _check(q, k, v, g, beta, h0, scalar_gate=True, config=config)


@pytest.mark.parametrize("t", [9, 37])
@pytest.mark.parametrize("config", [None, DK], ids=["default", "gram_dk"])
def test_raw_keys_and_strong_decay(t, config):
    # unnormalised keys (|o| grows fast: rel_err scales by the output's norm) and gates near -30: the
    # pairwise decays are summed directly, so a large cumulative gate costs no precision
    q, k, v, g, beta, h0 = _inputs(4, 1, 2, t, 24, 40, l2=False, strong_decay=True, h0=True)
    _check(q, k, v, g, beta, h0, config=config)


@pytest.mark.parametrize("config", [DOT, NO_REDUCE, FEW_SPLITS, TILES, DOT_TILES, DK, dict(DK, **FEW_SPLITS)],
                         ids=["state_dot", "no_reduce", "one_gram_program", "v_tiles", "state_dot_v_tiles", "gram_dk",
                              "gram_dk_one_program"])
def test_config_variants(config):
    # the final state by tl.dot instead of the token loop; the Gram partials summed in every solve
    # program instead of a reduce launch; one Gram program over all channels; several value tiles
    # per state program (V=40 in tiles of 16: the third tile half past V, a second program's tiles
    # all past it): the same results
    q, k, v, g, beta, h0 = _inputs(5, 1, 2, 37, 300, 40, h0=True, strong_decay=True)
    t = 37 if not config.get("STATE_DOT") else 11
    q, k, v, g, beta = q[:, :t], k[:, :t], v[:, :t], g[:, :t], beta[:, :t]
    _check(q, k, v, g, beta, h0, config=config)


@pytest.mark.parametrize("layout", ["bthf", "bhtf", "three"])
@pytest.mark.parametrize("config", [None, DOT, FUSED], ids=["default", "state_dot", "fused"])
def test_lead_dim_inputs(layout, config):
    # [B, H, T, *] views of FLA's [B, T, H, *] (B = 2: two stride groups, no copy), [B, H, T, *], a
    # three-group lead (copied); GQA (Hv = 2 Hq); T = 11 from t0 = 3 of a longer tensor; K = 12, V = 10
    check_kda_lead_forward(kp.forward, layout, config=config)


def test_lead_dim_inputs_scalar_gate_broadcast():
    # scalar gate [B, H, T] (a stride-0 view over the channels on top) and beta broadcast over the heads
    check_kda_lead_forward(kp.forward, "bthf", scalar_gate=True, broadcast=True, config=DOT)


def test_final_state_off_and_out_dtype():
    q, k, v, g, beta, h0 = _inputs(6, 1, 2, 11, 24, 40, h0=True)
    o_on, _ = _check(q, k, v, g, beta, h0, final=True)
    # without the final state (no Delta stored, no state kernel): the same o
    o_off, _ = _check(q, k, v, g, beta, h0, final=False)
    assert torch.equal(o_on, o_off)
    o_zero, _ = _check(q, k, v, g, beta, None, final=False)  # neither h0 nor the final state
    o16, _ = _check(q, k, v, g, beta, h0, final=False, out_dtype=torch.float16, tol=5e-3)
    assert o16.dtype == torch.float16 and not torch.equal(o_zero, o_on)


def test_strided_and_mixed_dtypes():
    """Inputs in FLA's [B, T, H, *] layout viewed as [H, T, *] (B = 1: a view, no copy), keys with a
    channel stride of 2, beta [T, N] transposed, h0 [N, V, K] transposed; q/k/v fp16 with g, beta
    fp32; GVA group 2."""
    qs, ks, vs, gs, bs, hs = kda_strided_views(7, 13, 2, 4, 24, 40)
    for config in (None, DOT):
        o, _ = _check(qs, ks, vs, gs, bs, hs, tol=5e-3, config=config)
        assert o.dtype == torch.float16


def test_empty_sequence_and_rows():
    # T = 0: o is empty, the final state is h0 (or zeros)
    q, k, v, g, beta, h0 = _inputs(8, 1, 2, 0, 24, 40, h0=True)
    with launch.poison_outputs():
        o, s = kp.forward(q, k, v, g, beta, scale=0.5, initial_state=h0, output_final_state=True)
        assert o.shape == (2, 0, 40) and torch.equal(s, h0)
        _, s = kp.forward(q, k, v, g, beta, scale=0.5, output_final_state=True)
        assert torch.equal(s, torch.zeros_like(h0))
    # N = 0: nothing to launch
    q, k, v, g, beta, _ = _inputs(8, 0, 2, 5, 24, 40)
    o, s = kp.forward(q, k, v, g, beta, scale=0.5, output_final_state=True)
    assert o.shape == (0, 5, 40) and s.shape == (0, 24, 40)


def test_kernels_for():
    def names(**kw):
        return [x.name for x in kp.kernels_for(k_dim=8192, v_dim=1024, dtype=torch.bfloat16, device=CPU, **kw)]

    assert names() == ["kda_parallel_interp"]
    assert names(initial_state=True, output_final_state=True, scalar_gate=True) == ["kda_parallel_h0_ht_interp"]
    source = kp.kernels_for(k_dim=24, v_dim=40, dtype=torch.float32, device=CPU, initial_state=True,
                            output_final_state=True)[0].source
    for fn in ("kda_parallel_prep_kernel", "kda_parallel_reduce_kernel", "kda_parallel_solve_kernel",
               "kda_parallel_state_kernel", "launch_kda_parallel"):
        assert f"def {fn}(" in source
    assert "def kda_parallel_fused_kernel(" in source  # with h0 as well
    assert "def kda_parallel_fused_kernel(" in kp.kernels_for(k_dim=24, v_dim=40, dtype=torch.float32, device=CPU,
                                                                output_final_state=True)[0].source
    assert "def kda_parallel_state_kernel(" not in kp.kernels_for(k_dim=24, v_dim=40, dtype=torch.float32,
                                                                   device=CPU)[0].source


# --------------------------------------------------------------------------------------------
# out=: o preallocated in the caller's layout
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("config", [None, DOT, FUSED], ids=["default", "state_dot", "fused"])
def test_out_layouts(config):
    # N = 8 rows as (b, h) = (2, 4): the op's [B, T, H, V] and [B, H, T, V] outputs, the fallback
    q, k, v, g, beta, h0 = _inputs(40, 4, 2, 13, 24, 20, h0=True)
    check_kda_out(kp.forward, q, k, v, g, beta, h0, tol=TOL[torch.float32], config=config)


def test_out_scalar_gate_float16_and_no_tokens():
    q, k, v, g, beta, _ = _inputs(41, 4, 2, 9, 24, 20, scalar_gate=True)
    check_kda_out(kp.forward, q, k, v, g, beta, None, tol=TOL[torch.float16], scalar_gate=True, out_dtype=torch.float16)
    q, k, v, g, beta, _ = _inputs(41, 4, 2, 0, 24, 20)
    check_kda_out_no_tokens(kp.forward, q, k, v, g, beta)


def test_bad_out():
    q, k, v, g, beta, _ = _inputs(42, 2, 2, 5, 24, 20)
    check_kda_bad_out(kp.forward, q, k, v, g, beta)


@pytest.mark.parametrize("config", [None, DOT, DK, FUSED], ids=["default", "state_dot", "gram_dk", "fused"])
@pytest.mark.parametrize("scalar", [False, True], ids=["channel", "scalar"])
def test_gates_are_floored_in_the_kernels(config, scalar):
    # gates of -inf (a hard reset) and far below GATE_FLOOR: as if clamped at it (exp is 0 either
    # way), no NaN from -inf - (-inf), with and without h0 (the projection and the state kernel);
    # the one-launch kernel at T = 15 (its factored Gram matrices: the row takes the pairwise path)
    from fuser.codegen.kda_chunk import GATE_FLOOR

    t = 15 if config is FUSED else 29
    for with_h0 in (False, True):
        q, k, v, g, beta, h0 = _inputs(43, 2, 1, t, 24, 20, scalar_gate=scalar, h0=with_h0)
        g[:, 4] = float("-inf")
        g[:, t - 12] = -1e30
        g[0, t - 4] = -250.0
        with launch.poison_outputs():
            o, s = kp.forward(q, k, v, g, beta, scale=0.5, initial_state=h0, output_final_state=True,
                              scalar_gate=scalar, config=config)
        ro, rs = _reference(q, k, v, g.clamp_min(GATE_FLOOR), beta, 0.5, h0, scalar)
        assert torch.isfinite(o).all() and torch.isfinite(s).all()
        assert rel_err(o, ro) < 1e-4 and rel_err(s, rs) < 1e-4


@pytest.mark.parametrize("config", [None, DK, FUSED], ids=["default", "gram_dk", "fused"])
def test_a_nan_gate_stays_nan(config):
    # the floor keeps NaN (torch's clamp_min does; a maximum might return the floor): the row of the
    # NaN gate is NaN from that token on (one chunk: maybe before it too), the other row untouched
    q, k, v, g, beta, h0 = _inputs(44, 2, 1, 15 if config is FUSED else 29, 24, 20, h0=True)
    g[1, 11, 3] = float("nan")
    o, s = kp.forward(q, k, v, g, beta, scale=0.5, initial_state=h0, output_final_state=True, config=config)
    ro, rs = _reference(q, k, v, g, beta, 0.5, h0, False)
    assert ro[1, 11:].isnan().all() and o[1, 11:].isnan().all() and s[1].isnan().any()
    assert rel_err(o[0], ro[0]) < 1e-4 and rel_err(s[0], rs[0]) < 1e-4


# --------------------------------------------------------------------------------------------
# The fused kernel (one launch: T <= 16, no h0)
# --------------------------------------------------------------------------------------------


def _fused(kd, vd, n, t, h0=False, config=FUSED):
    return kp._plan(kp._normalise({**kp._cfg(), **config}), n, t, kd, vd, h0, True)["FUSED"]


@pytest.mark.parametrize("t,kd,vd", [(1, 24, 70), (5, 24, 40), (8, 300, 70), (16, 40, 20)])
@pytest.mark.parametrize("h0", [False, True], ids=["zeros", "h0"])
def test_fused_matches_reference(t, kd, vd, h0):
    # grouped value heads; K = 300 and 40: ragged key blocks of 16; V = 70, 20: ragged value blocks;
    # T = 16: the whole [16, 16] block; with h0 its projections in the Gram loop and e^{G_T} S0 in
    # the state loop
    assert _fused(kd, vd, 2, t, h0=h0)
    q, k, v, g, beta, s0 = _inputs(50 + t, 1, 2, t, kd, vd, h0=h0)
    o_on, _ = _check(q, k, v, g, beta, s0, config=FUSED)
    o_off, _ = _check(q, k, v, g, beta, s0, final=False, config=FUSED)  # no state loop: the same o
    assert torch.equal(o_on, o_off)


@pytest.mark.parametrize("t", [8, 16])
def test_fused_float16_and_scalar_gate(t):
    q, k, v, g, beta, h0 = _inputs(60 + t, 2, 2, t, 24, 40, dtype=torch.float16, h0=True)
    _check(q, k, v, g, beta, None, config=FUSED)
    _check(q, k, v, g, beta, h0, config=FUSED)  # a float16 initial state
    q, k, v, g, beta, h0 = _inputs(61 + t, 2, 1, t, 24, 40, scalar_gate=True, h0=True)
    _check(q, k, v, g, beta, None, scalar_gate=True, config=FUSED)
    _check(q, k, v, g, beta, h0, scalar_gate=True, config=FUSED)


@pytest.mark.parametrize("gate", ["mild", "strong", "past_exact_h", "positive"])
def test_fused_raw_keys_and_strong_decay(gate):
    # raw keys (|o| grows); slightly positive gates; gates near -30 (|H| far past EXACT_H: the row's Gram matrices are
    # recomputed pairwise), or every gate -EXACT_H / 9.5 (|H| just past EXACT_H at T = 11, just
    # below at T = 10: both paths on one boundary)
    for t in (10, 11):
        q, k, v, g, beta, h0 = _inputs(70 + t, 1, 2, t, 24, 40, l2=False, strong_decay=gate == "strong", h0=True)
        if gate == "past_exact_h":
            g = torch.full_like(g, -kp.EXACT_H / 9.5)
            assert (g[:, 1:].sum(1).abs().max() > kp.EXACT_H) == (t == 11)
        if gate == "positive":  # slightly positive gates (a growing state): e^{H} > 1, e^{-H} < 1
            g = g.abs() * 0.1
        _check(q, k, v, g, beta, None if t == 10 else h0, config=FUSED)


def test_fused_only_where_the_call_allows_it():
    # FUSED asks for one launch; past 16 tokens the split kernels run (and are exact)
    assert _fused(24, 40, 2, 16) and not _fused(24, 40, 2, 17) and _fused(24, 40, 2, 8, h0=True)
    assert not _fused(24, 40, 2, 8, config={})
    for h0 in (False, True):
        plan = kp._plan(kp._normalise({**kp._cfg(), **FUSED}), 2, 8, 24, 40, h0, True)
        assert plan["WORK"] == 0  # no workspace
    q, k, v, g, beta, h0 = _inputs(82, 1, 2, 20, 24, 40, h0=True)
    _check(q, k, v, g, beta, None, config=FUSED)
    _check(q, k, v, g, beta, h0, config=FUSED)


def _bad(**change):
    q, k, v, g, beta, _ = _inputs(9, 2, 2, 5, 24, 40)
    kw = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=None, scale=0.5, scalar_gate=False, config=None,
              out_dtype=None)
    kw.update(change)
    return kw


@pytest.mark.parametrize("change,match", [
    (dict(q=torch.randn(2, 65, 24), k=torch.randn(2, 65, 24), v=torch.randn(4, 65, 40), g=torch.randn(4, 65, 24),
          beta=torch.rand(4, 65)), r"MAX_T=64.*use the recurrent or chunked kernels"),
    (dict(q=torch.randn(2, 5, 24, 1)), r"q and k must be \[NQ, T, K\]"),
    (dict(v=torch.randn(3, 5, 40)), r"multiple of NQ=2"),
    (dict(g=torch.randn(4, 5)), r"scalar_gate=True"),
    (dict(beta=torch.rand(4, 5, 1)), r"beta must be \[N, T\]"),
    (dict(initial_state=torch.randn(4, 40, 24)), r"initial_state must be \[N, K, V\]"),
    (dict(q=torch.randn(2, 5, 24, dtype=torch.float64), k=torch.randn(2, 5, 24, dtype=torch.float64)),
     r"supported: float32, float16, bfloat16"),
    (dict(out_dtype=torch.int32), r"out_dtype"),
    (dict(scale=float("inf")), r"scale must be a finite"),
    (dict(config={"BLOCK_K": 24}), r"BLOCK_K must be a power of two >= 16"),
    (dict(config={"BLOCK_VS": 8}), r"BLOCK_VS must be a power of two >= 16"),
    (dict(config={"BLOCK_K": 256, "BLOCK_V": 256}), r"exceeds 16384"),
    (dict(config={"STATE_DOT": 1}), r"STATE_DOT must be a bool"),
    (dict(config={"GRAM_DK": "yes"}), r"GRAM_DK must be a bool"),
    (dict(config={"DOT_PRECISION": "tf32"}), r"DOT_PRECISION"),
    (dict(config={"VARIANT": "registers"}), r"unknown config keys \['VARIANT'\]"),
    (dict(config={"num_warps": 3}), r"num_warps"),
    (dict(config={"V_TILES": 0}), r"V_TILES must be an int >= 1"),
    (dict(config={"FUSED": "yes"}), r"FUSED must be a bool"),
    (dict(config={"BLOCK_KF": 24}), r"BLOCK_KF must be a power of two >= 16"),
    (dict(config={"BLOCK_KF": 128, "BLOCK_VF": 256}), r"BLOCK_KF x BLOCK_VF = 128 x 256 exceeds 16384"),
    (dict(config={"WARPS_FUSED": 3}), r"WARPS_FUSED"),
])
def test_bad_inputs(change, match):
    kw = _bad(**change)
    with pytest.raises(ValueError, match=match):
        kp.forward(kw.pop("q"), kw.pop("k"), kw.pop("v"), kw.pop("g"), kw.pop("beta"), **kw)


def test_config_tables(monkeypatch):
    """GPU tables (sm90 / cuda, by device kind): valid rows, register tiles within bounds, the solve's
    grid about two programs per SM where the value dimension allows, plans for every T up to MAX_T."""
    for kind in ("sm90", "cuda"):
        monkeypatch.setattr(launch, "device_kind", lambda device, kind=kind: kind)
        for kd, vd, n in [(256, 8192, 2), (512, 16384, 2), (8192, 1024, 2), (16384, 1024, 2), (128, 128, 64),
                          (100, 72, None), (24, 40, 1)]:
            cands = kp.candidate_configs(k_dim=kd, v_dim=vd, dtype=torch.bfloat16, device="cuda", n_rows=n, t_len=8)
            assert cands and len(cands) == len({tuple(sorted(c.items())) for c in cands})
            for c in cands:
                assert kp.choose_config(k_dim=kd, v_dim=vd, dtype=torch.bfloat16, device="cuda", config=c) == c
                assert c["BLOCK_K"] * c["BLOCK_V"] <= 8192 and c["BLOCK_KP"] * c["BLOCK_VP"] <= 8192
                for t in (1, 8, 16, 37, 64):
                    plan = kp._plan(c, n or 4, t, kd, vd, True, True)
                    assert plan["TG"] ** 2 * plan["BLOCK_KG"] <= max(c["GRAM_TILE"], plan["TG"] ** 2)
                    assert plan["SPLIT_G"] * plan["K_PER_G"] >= kd
                    assert plan["FUSED"] or plan["SPLIT_P"] * plan["K_PER_P"] >= kd  # one launch: no key split
                    assert plan["WARPS_PREP"] <= 8 and plan["WARPS_SOLVE"] <= 8
            # the solve's grid: about two programs per SM, or the smallest value block (16); the short-T
            # rows at K <= 512 (T = 8 here) take 64 columns a program while that keeps one per SM
            if n is not None:
                want = 132 if (cands[0]["GRAM_STEPS"] == 1 and cands[0]["BLOCK_VS"] == 64) else 264
                assert n * launch.cdiv(vd, cands[0]["BLOCK_VS"]) >= min(want, n * launch.cdiv(vd, 16))
                short = kp._short_config(cands[-1], launch.next_power_of_2(kd), launch.next_power_of_2(vd), n, 8)
                assert (short is not None) == (kd <= 512 or kd >= 8192)
            # the one-launch kernel: the default at short T where the whole call is small (K <= 64, V <= 128)
            assert cands[0]["FUSED"] == (kd <= 64 and vd <= 128), (kd, vd)
            assert kp._plan(cands[0], n or 4, 8, kd, vd, False, True)["FUSED"] == (kd <= 64 and vd <= 128)
            assert not kp._plan(cands[0], n or 4, 37, kd, vd, False, True)["FUSED"]


def test_hbm_bytes():
    n, nq, t, kd, vd = 2, 2, 8, 8192, 1024
    inputs = 2 * nq * t * kd * 2 + n * t * (vd + kd + 1) * 2 + n * t * vd * 2
    state = n * kd * vd * 4
    delta = n * t * vd * 4
    assert kp.hbm_bytes(n, nq, t, kd, vd, 2, False, False) == inputs
    assert kp.hbm_bytes(n, nq, t, kd, vd, 2, False, True) == inputs + state + 2 * delta
    assert kp.hbm_bytes(n, nq, t, kd, vd, 2, True, True) == inputs + 3 * state + 2 * delta + 4 * delta
    assert kp.hbm_bytes(n, nq, t, kd, vd, 2, True, False, state_bytes=2) == inputs + state // 2 + 4 * delta
    assert (kp.hbm_bytes(n, nq, t, kd, vd, 2, False, False, scalar_gate=True) == inputs - n * t * (kd - 1) * 2)
    # one launch: no workspace, h0 read once
    assert kp.hbm_bytes(n, nq, t, kd, vd, 2, False, True, fused=True) == inputs + state
    assert kp.hbm_bytes(n, nq, t, kd, vd, 2, True, True, fused=True) == inputs + 2 * state


# --------------------------------------------------------------------------------------------
# GPU (compiled kernels; run by the lead on the H100)
# --------------------------------------------------------------------------------------------

GPU = torch.device("cuda")

#: the kernel blogs' short-sequence shapes (B=1, T=8, H=2): (K, V)
BLOG_SHAPES = [(256, 8192), (512, 16384), (8192, 1024), (16384, 1024)]


@pytest.mark.gpu
@pytest.mark.parametrize("kd,vd", BLOG_SHAPES)
@pytest.mark.parametrize("h0", [False, True], ids=["zeros", "h0"])
def test_gpu_blog_shapes(kd, vd, h0):
    q, k, v, g, beta, s0 = _inputs(10, 2, 1, 8, kd, vd, dtype=torch.bfloat16, device=GPU, h0=h0)
    g = g.float()  # the gate kept in fp32, as models often do
    _check(q, k, v, g, beta, None if s0 is None else s0.float(), scale=kd ** -0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, DOT, NO_REDUCE, {"DOT_PRECISION": "ieee"}, {"STATE_DOT": False},
                                    {"STATE_DOT": True, "V_TILES": 3, "BLOCK_V": 64}, DK],
                         ids=["default", "state_dot", "no_reduce", "ieee", "token_loop", "state_dot_v_tiles",
                              "gram_dk"])
@pytest.mark.parametrize("t", [1, 8, 16, 37, 64])
def test_gpu_lengths_and_configs(config, t):
    q, k, v, g, beta, h0 = _inputs(11, 4, 2, t, 300, 200, device=GPU, h0=True, strong_decay=True)
    _check(q, k, v, g, beta, h0, scale=300 ** -0.5, config=config)


GPU_FUSED = [{"FUSED": True, "BLOCK_KF": kf, "BLOCK_VF": vf, "WARPS_FUSED": w}
             for kf, vf, w in ((64, 64, 4), (32, 128, 4), (128, 32, 8), (16, 16, 2))]


@pytest.mark.gpu
@pytest.mark.parametrize("config", GPU_FUSED, ids=["kf64_vf64", "kf32_vf128", "kf128_vf32_w8", "kf16_vf16_w2"])
@pytest.mark.parametrize("gates", ["mild", "strong", "past_exact_h", "scalar", "bf16", "h0"])
@pytest.mark.parametrize("t", [1, 8, 16])
def test_gpu_fused(config, gates, t):
    # the one-launch kernel compiled: libdevice's exp on the factors, the double-float scan, the
    # pairwise fallback past EXACT_H, an initial state; K = 300, V = 200 ragged in every block size
    dtype = torch.bfloat16 if gates == "bf16" else torch.float32
    q, k, v, g, beta, h0 = _inputs(16 + t, 4, 2, t, 300, 200, device=GPU, dtype=dtype, strong_decay=gates == "strong",
                                   scalar_gate=gates == "scalar", h0=gates == "h0")
    if gates == "past_exact_h":
        g = torch.full_like(g, -kp.EXACT_H / max(1, t - 1) * 1.01)
    if dtype == torch.bfloat16:
        g = g.float()
    _check(q, k, v, g, beta, h0, scale=300 ** -0.5, config=config, scalar_gate=gates == "scalar")
    _check(q, k, v, g, beta, h0, scale=300 ** -0.5, config=config, scalar_gate=gates == "scalar", final=False)


@pytest.mark.gpu
def test_gpu_fused_gates_near_exact_h_match_the_eager_loop():
    # the dot path at |H| up to just below EXACT_H (the factors' exponents as large as they get):
    # o and the final state as close to float64 as the eager float32 loop's, within 3x
    t, kd, vd = 16, 128, 256
    q, k, v, g, beta, _ = _inputs(30, 2, 1, t, kd, vd, device=GPU)
    g = -(0.9 + 0.1 * torch.rand_like(g)) * 0.98 * kp.EXACT_H / (t - 1)  # |H| of 53-59 at the last token
    assert g[:, 1:].sum(1).abs().max() < kp.EXACT_H
    o, s = _check(q, k, v, g, beta, None, scale=kd ** -0.5, config={"FUSED": True})
    ro, rs = _reference(q, k, v, g, beta, kd ** -0.5, None, False)
    eager_o, eager_s = (rel_err(x, ref) for x, ref in zip(kda_eager_loop(q, k, v, g, beta, kd ** -0.5, torch.float32),
                                                            (ro, rs)))
    assert rel_err(o, ro) < 3 * eager_o + 1e-6 and rel_err(s, rs) < 3 * eager_s + 1e-7, (
        rel_err(o, ro), eager_o, rel_err(s, rs), eager_s)


@pytest.mark.gpu
@pytest.mark.parametrize("scalar_gate", [False, True])
def test_gpu_bf16_gva_scalar_gate(scalar_gate):
    q, k, v, g, beta, h0 = _inputs(12, 8, 2, 20, 128, 128, dtype=torch.bfloat16, device=GPU, h0=True,
                                   scalar_gate=scalar_gate)
    _check(q, k, v, g, beta, h0.float(), scale=128 ** -0.5, scalar_gate=scalar_gate)


@pytest.mark.gpu
def test_gpu_ragged_strided_fp16():
    t, h, hv, kd, vd = 29, 3, 6, 100, 72
    q, k, v, g, beta, h0 = _inputs(13, h, hv // h, t, kd, vd, dtype=torch.float16, device=GPU, h0=True)
    qs = q.transpose(0, 1).contiguous().transpose(0, 1)  # [H, T, K] with strides of [T, H, K]
    vs = v.transpose(0, 1).contiguous().transpose(0, 1)
    for config in (None, DOT):
        _check(qs, k, vs, g, beta, h0, config=config, out_dtype=torch.bfloat16, tol=3e-2)


@pytest.mark.gpu
def test_gpu_deterministic():
    q, k, v, g, beta, h0 = _inputs(14, 2, 1, 8, 8192, 256, dtype=torch.bfloat16, device=GPU, h0=True)
    a = kp.forward(q, k, v, g, beta, scale=0.1, initial_state=h0, output_final_state=True)
    b = kp.forward(q, k, v, g, beta, scale=0.1, initial_state=h0, output_final_state=True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.gpu
def test_gpu_new_length_does_not_recompile():
    """Lengths in one padded bucket (9..16) share every compiled kernel. (Lengths whose row
    strides T·24 and T·40 are all ≡ 8 mod 16: Triton itself specialises a stride divisible by 16,
    at most one more variant per kernel, as for any kernel it launches — found on the H100.)"""
    mod = kp._module(False, True, False)[1]
    kernels = (mod.kda_parallel_prep_kernel, mod.kda_parallel_solve_kernel, mod.kda_parallel_state_kernel,
               mod.kda_parallel_fused_kernel)
    for t in (9, 11, 13):
        q, k, v, g, beta, _ = _inputs(15, 1, 2, t, 24, 40, device=GPU)
        for config in ({"FUSED": False}, {"FUSED": True}):  # the split kernels and the one launch
            _check(q, k, v, g, beta, config=config)
        if t == 9:
            before = [compiled_keys(fn) for fn in kernels]
            assert all(before), before
    assert [compiled_keys(fn) for fn in kernels] == before


# --------------------------------------------------------------------------------------------
# Property test: any valid config, any small problem (interpreter)
# --------------------------------------------------------------------------------------------


@st.composite
def _problems(draw):
    """A random small problem and a random launch config of the parallel form (every key the
    table varies: the Gram split, its layout, the reduce launch, the solve and state blocks)."""
    return dict(
        nq=draw(st.sampled_from([1, 2])), group=draw(st.sampled_from([1, 2])), t=draw(st.integers(1, 40)),
        kd=draw(st.sampled_from([5, 24, 70, 130])), vd=draw(st.sampled_from([3, 16, 40])),
        scalar_gate=draw(st.booleans()), h0=draw(st.booleans()), final=draw(st.booleans()),
        strong=draw(st.booleans()), seed=draw(st.integers(0, 2**31 - 1)),
        config={"GRAM_DK": draw(st.booleans()), "GRAM_TILE": draw(st.sampled_from([256, 2048, 4096])),
                "GRAM_STEPS": draw(st.sampled_from([1, 2, 8])), "REDUCE_OVER": draw(st.sampled_from([1, 128, 1 << 20])),
                "BLOCK_VS": draw(st.sampled_from([16, 32])), "BLOCK_K": draw(st.sampled_from([16, 32])),
                "BLOCK_V": draw(st.sampled_from([16, 32])), "V_TILES": draw(st.sampled_from([1, 3])),
                "STATE_DOT": draw(st.booleans()), "FUSED": draw(st.booleans()),
                "BLOCK_KF": draw(st.sampled_from([16, 64])), "BLOCK_VF": draw(st.sampled_from([16, 32]))},
    )


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_problems())
def test_any_config_matches_reference(p):
    q, k, v, g, beta, h0 = _inputs(p["seed"], p["nq"], p["group"], p["t"], p["kd"], p["vd"],
                                   scalar_gate=p["scalar_gate"], h0=p["h0"], strong_decay=p["strong"])
    _check(q, k, v, g, beta, h0, scalar_gate=p["scalar_gate"], final=p["final"], config=p["config"])
