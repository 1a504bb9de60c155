"""The token-recurrent KDA forward kernels (codegen/kda_recurrent.py + templates/kda_recurrent.py.jinja)
against the float64 reference (patterns/kda_reference.py).

On CPU the kernels run in Triton's interpreter at small, ragged sizes (T, K, V not multiples of the
blocks nor powers of two); tests marked ``gpu`` run the compiled kernels at realistic sizes. Every
output is allocated poisoned (NaN), so an element a kernel fails to write shows up. Both variants
run everywhere: "streamed" is forced through ``config`` with small key tiles, and the registers
tile in both layouts (``STATE_LAYOUT``).
"""

from __future__ import annotations

import pytest
from _kernel_checks import CPU, check_kda_bad_out, check_kda_forward, check_kda_lead_forward, check_kda_out, compiled_keys
from _kernel_checks import check_kda_out_no_tokens
from _kernel_checks import kda_strided_views, rel_err
from _kernel_checks import KDA_TOL as TOL
from _kernel_checks import kda_inputs as _inputs
import torch

from fuser.codegen import kda_recurrent as kr
from fuser.codegen import launch

REGS = {"VARIANT": "registers", "STATE_LAYOUT": "kv"}
VK = {"VARIANT": "registers", "STATE_LAYOUT": "vk"}     # the state tile held transposed
STREAM16 = {"VARIANT": "streamed", "BLOCK_K": 16}   # K=24: two key tiles, the second ragged
STREAM8 = {"VARIANT": "streamed", "BLOCK_K": 8, "BLOCK_V": 16}


def _check(*args, **kwargs):
    """The launcher against the float64 reference (``_kernel_checks.check_kda_forward``)."""
    return check_kda_forward(kr.forward, *args, **kwargs)


# --------------------------------------------------------------------------------------------
# CPU (interpreter)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", [REGS, VK, STREAM16], ids=["registers", "vk", "streamed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_reference(config, dtype):
    # T=37, K=24, V=40 (three value blocks of 16, the last ragged), grouped value heads (2), h0
    q, k, v, g, beta, h0 = _inputs(1, 1, 2, 37, 24, 40, dtype=dtype, h0=True)
    _check(q, k, v, g, beta, h0, config=config)


@pytest.mark.parametrize("config", [REGS, VK, STREAM8], ids=["registers", "vk", "streamed"])
def test_scalar_gate(config):
    q, k, v, g, beta, h0 = _inputs(2, 2, 1, 13, 24, 20, scalar_gate=True, h0=True)
    _check(q, k, v, g, beta, h0, scalar_gate=True, config=config)


@pytest.mark.parametrize("config", [REGS, VK, STREAM16], ids=["registers", "vk", "streamed"])
def test_raw_keys_and_strong_decay(config):
    # unnormalised keys (|o| grows fast: rel_err scales by the output's norm) and gates near -30
    q, k, v, g, beta, _ = _inputs(3, 1, 2, 9, 24, 40, l2=False, strong_decay=True)
    _check(q, k, v, g, beta, config=config)


@pytest.mark.parametrize("config", [REGS, VK, STREAM8], ids=["registers", "vk", "streamed"])
def test_one_token(config):
    q, k, v, g, beta, h0 = _inputs(4, 2, 2, 1, 24, 40, h0=True)
    _check(q, k, v, g, beta, h0, config=config)


@pytest.mark.parametrize("config", [REGS, VK, STREAM16], ids=["registers", "vk", "streamed"])
def test_final_state_off_and_out_dtype(config):
    q, k, v, g, beta, h0 = _inputs(5, 1, 2, 11, 24, 40, h0=True)
    o_on, _ = _check(q, k, v, g, beta, h0, config=config, final=True)
    # without the final state (streamed: a scratch workspace instead of the final buffer): same o
    o_off, _ = _check(q, k, v, g, beta, h0, config=config, final=False)
    assert torch.equal(o_on, o_off)
    # o in another dtype than v (fp32 inputs, fp16 o)
    o16, _ = _check(q, k, v, g, beta, h0, config=config, final=False, out_dtype=torch.float16, tol=5e-3)
    assert o16.dtype == torch.float16


@pytest.mark.parametrize("config", [REGS, VK, STREAM16], ids=["registers", "vk", "streamed"])
def test_strided_and_mixed_dtypes(config):
    """Inputs in FLA's [B, T, H, *] layout viewed as [H, T, *] (B = 1: a view, no copy), keys with a
    channel stride of 2, beta [T, N] transposed, h0 [N, V, K] transposed; q/k/v fp16 with g, beta
    fp32; GVA group 2."""
    qs, ks, vs, gs, bs, hs = kda_strided_views(6, 17, 2, 4, 24, 40)
    o, s = _check(qs, ks, vs, gs, bs, hs, config=config, tol=5e-3)
    assert o.dtype == torch.float16


def test_large_key_dim_streamed_default():
    # K too large for registers: the default config streams the state (K=3000: not a power of two)
    q, k, v, g, beta, h0 = _inputs(7, 1, 2, 4, 3000, 20, h0=True)
    cfg = kr.choose_config(k_dim=3000, v_dim=20, dtype=q.dtype, device=CPU, n_rows=2)
    assert cfg["VARIANT"] == "streamed" and cfg["BLOCK_K"] < 3000
    _check(q, k, v, g, beta, h0)
    assert [x.name for x in kr.kernels_for(k_dim=3000, v_dim=20, dtype=q.dtype, device=CPU, initial_state=True,
                                           output_final_state=True)] == ["kda_recurrent_streamed_h0_interp"]


def test_empty_sequence_and_rows():
    # T = 0: o is empty, the final state is h0 (or zeros)
    q, k, v, g, beta, h0 = _inputs(8, 1, 2, 0, 24, 40, h0=True)
    for config in (REGS, STREAM16):
        with launch.poison_outputs():
            o, s = kr.forward(q, k, v, g, beta, scale=0.5, initial_state=h0, output_final_state=True, config=config)
        assert o.shape == (2, 0, 40) and torch.equal(s, h0)
    # N = 0: nothing to launch
    q, k, v, g, beta, _ = _inputs(8, 0, 2, 5, 24, 40)
    o, s = kr.forward(q, k, v, g, beta, scale=0.5, output_final_state=True)
    assert o.shape == (0, 5, 40) and s.shape == (0, 24, 40)


# --------------------------------------------------------------------------------------------
# out=: o preallocated in the caller's layout
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("config", [REGS, VK, STREAM16], ids=["registers", "vk", "streamed"])
def test_out_layouts(config):
    # N = 8 rows as (b, h) = (2, 4): the op's [B, T, H, V] and [B, H, T, V] outputs, o in float16
    q, k, v, g, beta, h0 = _inputs(20, 4, 2, 7, 24, 20, h0=True)
    check_kda_out(kr.forward, q, k, v, g, beta, h0, tol=TOL[torch.float32], config=config)
    if config is REGS:
        check_kda_out(kr.forward, q, k, v, g, beta, h0, tol=TOL[torch.float16], config=config, out_dtype=torch.float16)


def test_out_scalar_gate_and_no_tokens():
    q, k, v, g, beta, h0 = _inputs(21, 4, 2, 5, 24, 20, scalar_gate=True, h0=True)
    check_kda_out(kr.forward, q, k, v, g, beta, h0, tol=TOL[torch.float32], scalar_gate=True)
    q, k, v, g, beta, _ = _inputs(21, 4, 2, 0, 24, 20)
    check_kda_out_no_tokens(kr.forward, q, k, v, g, beta)


def test_bad_out():
    q, k, v, g, beta, _ = _inputs(22, 2, 2, 5, 24, 20)
    check_kda_bad_out(kr.forward, q, k, v, g, beta)
    # out's dtype is o's: out_dtype when given
    with pytest.raises(ValueError, match=r"out has dtype torch.float32, o's is torch.float16"):
        kr.forward(q, k, v, g, beta, scale=0.5, out_dtype=torch.float16, out=torch.empty(4, 5, 20))


@pytest.mark.parametrize("layout,config", [("bthf", REGS), ("bhtf", REGS), ("three", REGS), ("bthf", STREAM8),
                                           ("bhtf", VK)],
                         ids=["bthf", "bhtf", "three", "bthf-streamed", "bhtf-vk"])
def test_lead_dim_inputs(layout, config):
    # [B, H, T, *] views of FLA's [B, T, H, *] (B = 2, two stride groups), [B, H, T, *], and lead
    # dims in three groups (copied); GQA (Hv = 2 Hq), a window t0 = 3 of longer tensors, K = 12, V = 10
    check_kda_lead_forward(kr.forward, layout, config=config)


@pytest.mark.parametrize("broadcast", [False, True], ids=["own", "broadcast"])
def test_lead_dim_inputs_scalar_gate(broadcast):
    # the scalar gate [B, H, T] in two groups; with broadcast, g and beta shared by the heads (stride 0)
    check_kda_lead_forward(kr.forward, "bthf", scalar_gate=True, broadcast=broadcast, config=VK if broadcast else REGS)


def test_lead_dim_inputs_bad_shapes():
    q, k, v, g, beta, _ = _inputs(23, 2, 2, 5, 24, 20)
    with pytest.raises(ValueError, match=r"q and k must be \[NQ, T, K\]"):
        kr.forward(q[0], k[0], v, g, beta, scale=0.5)               # no lead dim
    with pytest.raises(ValueError, match=r"g must be \[N, T, K\]"):
        kr.forward(q, k, v, g.view(2, 2, 5, 24)[:1], beta, scale=0.5)
    with pytest.raises(ValueError, match=r"beta must be \[N, T\]"):
        kr.forward(q, k, v, g, beta.view(4, 5, 1), scale=0.5)
    o, _ = kr.forward(q.view(1, 2, 5, 24), k.view(1, 2, 5, 24), v.view(2, 2, 5, 20), g.view(4, 1, 5, 24),
                      beta.view(2, 2, 5), scale=0.5)                 # any lead shapes of the right products
    assert rel_err(o, kr.forward(q, k, v, g, beta, scale=0.5)[0]) == 0


def test_row_groups():
    assert kr.row_groups((), ()) == (1, 0, 0)
    assert kr.row_groups((2, 3), (3 * 80, 80)) == (1, 80, 0)            # contiguous: one group
    assert kr.row_groups((2, 3), (5 * 3 * 16, 16)) == (3, 240, 16)      # [B, T, H, V] moved: two
    assert kr.row_groups((1, 3, 1), (999, 16, 7)) == (1, 16, 0)         # size-1 dims dropped
    assert kr.row_groups((2, 3, 4), (1, 2, 6)) is None                  # three groups
    assert kr.row_groups((2, 3, 4), (12 * 9, 4 * 9, 9)) == (1, 9, 0)    # merge into one


def _bad(**change):
    q, k, v, g, beta, _ = _inputs(9, 2, 2, 5, 24, 40)
    kw = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=None, scale=0.5, scalar_gate=False, config=None,
              out_dtype=None)
    kw.update(change)
    return kw


@pytest.mark.parametrize("change,match", [
    (dict(q=torch.randn(2, 5, 24, 1)), r"q and k must be \[NQ, T, K\]"),
    (dict(k=torch.randn(2, 5, 16)), r"q and k must be \[NQ, T, K\]"),
    (dict(v=torch.randn(3, 5, 40)), r"multiple of NQ=2"),
    (dict(v=torch.randn(4, 6, 40)), r"v must be \[N, T=5, V\]"),
    (dict(g=torch.randn(4, 5)), r"scalar_gate=True"),
    (dict(scalar_gate=True), r"g must be \[N, T\]"),
    (dict(beta=torch.rand(4, 5, 1)), r"beta must be \[N, T\]"),
    (dict(initial_state=torch.randn(4, 40, 24)), r"initial_state must be \[N, K, V\]"),
    (dict(q=torch.randn(2, 5, 24, dtype=torch.float64), k=torch.randn(2, 5, 24, dtype=torch.float64)),
     r"supported: float32, float16, bfloat16"),
    (dict(out_dtype=torch.int32), r"out_dtype"),
    (dict(scale=float("nan")), r"scale must be a finite"),
    (dict(config={"VARIANT": "chunked"}), r"VARIANT must be one of"),
    (dict(config={"VARIANT": "streamed", "BLOCK_K": 24}), r"BLOCK_K must be a power of two"),
    (dict(config={"VARIANT": "registers", "BLOCK_K": 16}), r"BLOCK_K must be next_power_of_2\(K\) = 32"),
    (dict(config={"VARIANT": "registers", "BLOCK_V": 1024}), r"VARIANT='streamed'"),
    (dict(config={"num_warps": 3}), r"num_warps"),
    (dict(config={"STATE_LAYOUT": "kvT"}), r"STATE_LAYOUT must be one of \('kv', 'vk'\)"),
    (dict(config={"VARIANT": "streamed", "STATE_LAYOUT": "vk"}), r"STATE_LAYOUT must be 'kv'.*VARIANT='registers'"),
])
def test_bad_inputs(change, match):
    kw = _bad(**change)
    with pytest.raises(ValueError, match=match):
        kr.forward(kw.pop("q"), kw.pop("k"), kw.pop("v"), kw.pop("g"), kw.pop("beta"), **kw)


def test_config_tables(monkeypatch):
    """GPU tables (sm90 / cuda, by device kind): registers first up to K_pad = 1024 with BLOCK_K = K's
    padded size, the streamed variant first above; without N (the old table) first choices keep
    tiles <= 8192 elements, every candidate <= REGISTER_TILE_MAX; each candidate is accepted as an
    explicit config."""
    for kind in ("sm90", "cuda"):
        _as_gpu(monkeypatch, kind)
        for kd, vd, n in [(3, 5, 2), (64, 64, 4), (128, 128, 32), (100, 72, 8), (256, 256, 16), (512, 128, 8),
                          (1024, 128, 8), (1500, 128, 8), (8192, 128, 16), (16384, 256, 4), (16384, 64, None)]:
            cands = kr.candidate_configs(k_dim=kd, v_dim=vd, dtype=torch.bfloat16, device="cuda", n_rows=n)
            assert cands
            k_pad = max(4, launch.next_power_of_2(kd))
            first = cands[0]
            assert first["VARIANT"] == ("registers" if k_pad <= kr.REGISTERS_MAX_K else "streamed"), (kd, first)
            assert first["BLOCK_K"] * first["BLOCK_V"] <= (8192 if n is None else kr.REGISTER_TILE_MAX)
            assert len({c["VARIANT"] for c in cands}) == (2 if k_pad <= 2048 else 1)
            for c in cands:
                assert kr.choose_config(k_dim=kd, v_dim=vd, dtype=torch.bfloat16, device="cuda", config=c) == c
                assert c["BLOCK_K"] * c["BLOCK_V"] <= kr.REGISTER_TILE_MAX
                assert c["num_warps"] in (1, 2, 4, 8) and c["num_stages"] >= 1
                assert c["BLOCK_K"] == k_pad if c["VARIANT"] == "registers" else c["BLOCK_K"] <= k_pad
        # a partial config takes the rest from its variant's first row
        cfg = kr.choose_config(k_dim=8192, v_dim=128, dtype=torch.bfloat16, device="cuda",
                               config={"BLOCK_K": 256})
        assert cfg == dict(kr.candidate_configs(k_dim=8192, v_dim=128, dtype=torch.bfloat16, device="cuda")[0],
                           BLOCK_K=256)
        cfg = kr.choose_config(k_dim=100, v_dim=128, dtype=torch.bfloat16, device="cuda",
                               config={"VARIANT": "streamed"})
        assert cfg["VARIANT"] == "streamed" and cfg["BLOCK_K"] <= 128


def _as_gpu(monkeypatch, kind="sm90", sms=132):
    monkeypatch.setattr(launch, "device_kind", lambda device: kind)
    monkeypatch.setattr(launch, "sm_count", lambda device: sms)


@pytest.mark.parametrize("kd,vd,n,want", [
    # the measured fastest (benchmarks/results/kda_recurrent_configs.md, device µs on the H100)
    (64, 8192, 16, (64, 1, "kv")),    # 167 µs at T=64, BLOCK_V 8 (the old default): 296
    (128, 16384, 2, (16, 1, "kv")),   # 126 µs at T=64, BLOCK_V 8 / 2 warps: 174
    (128, 128, 2, (8, 1, "kv")),      # few programs: the smallest block, one warp
    (256, 128, 2, (8, 4, "kv")),      # 34 µs at T=64, BLOCK_V 8 / 1 warp: 43
    (256, 8192, 2, (16, 1, "vk")),    # the state tile transposed: 113 µs at T=64, the kv pick (16/4): 142
    (512, 1024, 16, (8, 1, "vk")),    # 211 µs at T=64, the kv pick (16/4): 301
    (200, 1000, 16, None),      # K, V not powers of two: whatever the model says, within its table
])
def test_registers_configs_follow_the_measured_model(monkeypatch, kd, vd, n, want):
    """On a GPU with N known, the registers configs are REGISTERS_MODEL's at K_pad ordered by a
    token's modelled time at this N and V (then the fixed part): the measured fastest first at
    shapes of the sweep; every candidate one the sweep measured, no wider than V; without N the
    old table's order."""
    _as_gpu(monkeypatch)
    cands = kr.candidate_configs(k_dim=kd, v_dim=vd, dtype=torch.bfloat16, device="cuda", n_rows=n)
    k_pad = launch.next_power_of_2(kd)
    regs = [(c["BLOCK_V"], c["num_warps"], c["STATE_LAYOUT"]) for c in cands if c["VARIANT"] == "registers"]
    assert cands[0]["VARIANT"] == "registers" and cands[0]["BLOCK_K"] == k_pad
    if want is not None:
        assert regs[0] == want, regs
    assert set(regs) <= set(kr.REGISTERS_MODEL[k_pad])
    assert all(bv <= max(8, launch.next_power_of_2(vd)) for bv, _, _ in regs)

    def token_us(c):
        resident, fixed, token = kr.REGISTERS_MODEL[k_pad][c]
        return token * max(1.0, n * -(-vd // c[0]) / (resident * 132)), fixed

    assert regs == sorted(regs, key=token_us)
    assert kr.choose_config(k_dim=kd, v_dim=vd, dtype=torch.bfloat16, device="cuda", n_rows=n) == cands[0]
    old = kr.candidate_configs(k_dim=kd, v_dim=vd, dtype=torch.bfloat16, device="cuda")
    assert (old[0]["BLOCK_V"], old[0]["num_warps"]) == (min(8, vd), kr._REGS_TABLE[k_pad][0][1])


def test_a_partial_config_takes_the_rest_from_a_row_like_it(monkeypatch):
    """A partial config's missing keys come from the table's row agreeing with most of the given
    keys: at K=256, V=8192, N=2 the first row holds the tile transposed at one warp; a user's
    ``{"BLOCK_V": 16, "num_warps": 4}`` gets the measured 16 / 4 row's layout (kv), and a layout
    named alone takes the best row of that layout."""
    _as_gpu(monkeypatch)
    kw = dict(k_dim=256, v_dim=8192, dtype=torch.bfloat16, device="cuda", n_rows=2)
    cands = kr.candidate_configs(**kw)
    assert cands[0]["STATE_LAYOUT"] == "vk" and cands[0]["num_warps"] == 1
    cfg = kr.choose_config(config={"BLOCK_V": 16, "num_warps": 4}, **kw)
    assert (cfg["BLOCK_V"], cfg["num_warps"], cfg["STATE_LAYOUT"]) == (16, 4, "kv")
    assert cfg == next(c for c in cands if (c["BLOCK_V"], c["num_warps"], c["STATE_LAYOUT"]) == (16, 4, "kv"))
    cfg = kr.choose_config(config={"STATE_LAYOUT": "kv"}, **kw)
    assert cfg == next(c for c in cands if c["STATE_LAYOUT"] == "kv")
    # keys no row has: the first row, the given keys over it
    cfg = kr.choose_config(config={"num_warps": 16}, **kw)
    assert cfg == dict(cands[0], num_warps=16)


def test_a_symbolic_row_count_is_not_guarded_on(monkeypatch):
    """The config order reads N only when it is a plain int: a symbolic N (dynamic batch) keeps the
    table's order and adds no guard on N (the graph would otherwise recompile, or fail under
    mark_dynamic, for another batch size)."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    _as_gpu(monkeypatch)
    env = ShapeEnv()
    n = env.create_symintnode(env.create_symbol(16, torch._dynamo.source.ConstantSource("n")), hint=16)
    cands = kr.candidate_configs(k_dim=64, v_dim=8192, dtype=torch.bfloat16, device="cuda", n_rows=n)
    assert cands == kr.candidate_configs(k_dim=64, v_dim=8192, dtype=torch.bfloat16, device="cuda")
    assert not env.guards
    assert kr.candidate_configs(k_dim=64, v_dim=8192, dtype=torch.bfloat16, device="cuda", n_rows=16) != cands


def test_registers_order_uses_the_devices_sm_count(monkeypatch):
    """Waves depend on the SMs: K=64, V=1024, N=2 (256 programs at BLOCK_V 8) is one wave on 132
    SMs (BLOCK_V 8 first) and several on 16 (a wider block first)."""
    firsts = {}
    for sms in (132, 16):
        _as_gpu(monkeypatch, "cuda", sms)
        c = kr.candidate_configs(k_dim=64, v_dim=1024, dtype=torch.bfloat16, device="cuda", n_rows=2)[0]
        firsts[sms] = c["BLOCK_V"]
    assert firsts[132] == 8 and firsts[16] > 8


def test_registers_model_row():
    """K_pad clamped into the measured 64 … 1024; an unmeasured config takes the nearest measured one
    of its layout (else of "kv")."""
    assert kr.registers_model_row(16, 8, 1) == kr.REGISTERS_MODEL[64][(8, 1, "kv")]
    assert kr.registers_model_row(2048, 8, 8) == kr.REGISTERS_MODEL[1024][(8, 8, "kv")]
    assert kr.registers_model_row(512, 16, 2) == kr.REGISTERS_MODEL[512][(16, 4, "kv")]  # spills: not in the table
    assert (16, 2, "kv") not in kr.REGISTERS_MODEL[512]
    for k_pad, table in kr.REGISTERS_MODEL.items():
        assert all(res > 0 and fixed > 0 and token > 0 for res, fixed, token in table.values())
        assert {lay for _, _, lay in table} <= set(kr.STATE_LAYOUTS)
        vk = [c for c in table if c[2] == "vk"]
        for bv, w, _ in vk:
            assert kr.registers_model_row(k_pad, bv, w, "vk") == table[(bv, w, "vk")]
        if vk:  # an unmeasured vk config: the nearest vk row, never a kv one
            assert kr.registers_model_row(k_pad, 8, 8, "vk") in [table[c] for c in vk]
        else:
            assert kr.registers_model_row(k_pad, 8, 1, "vk") == kr.registers_model_row(k_pad, 8, 1, "kv")


def test_hbm_bytes():
    n, nq, t, kd, vd = 8, 4, 100, 128, 64
    inputs = 2 * nq * t * kd * 2 + n * t * (vd + kd + 1) * 2 + n * t * vd * 2
    state = n * kd * vd * 4
    assert kr.hbm_bytes(n, nq, t, kd, vd, 2, "registers", False, False) == inputs
    assert kr.hbm_bytes(n, nq, t, kd, vd, 2, "registers", True, True) == inputs + 2 * state
    assert kr.hbm_bytes(n, nq, t, kd, vd, 2, "streamed", False, True) == inputs + (1 + 3 * t) * state
    assert kr.hbm_bytes(n, nq, t, kd, vd, 2, "streamed", False, False) == inputs + (1 + 3 * t) * state
    assert (kr.hbm_bytes(n, nq, t, kd, vd, 2, "registers", False, False, scalar_gate=True)
            == inputs - n * t * (kd - 1) * 2)
    with pytest.raises(ValueError):
        kr.hbm_bytes(n, nq, t, kd, vd, 2, "chunked", False, False)


# --------------------------------------------------------------------------------------------
# GPU (compiled kernels; run by the lead on the H100)
# --------------------------------------------------------------------------------------------

GPU = torch.device("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, {"VARIANT": "registers", "BLOCK_V": 32, "num_warps": 4, "STATE_LAYOUT": "kv"},
                                    {"VARIANT": "registers", "BLOCK_V": 16, "num_warps": 1, "STATE_LAYOUT": "vk"},
                                    {"VARIANT": "streamed", "BLOCK_K": 32}], ids=["default", "registers32", "vk16", "streamed"])
@pytest.mark.parametrize("scalar_gate", [False, True])
def test_gpu_bf16(config, scalar_gate):
    q, k, v, g, beta, h0 = _inputs(10, 8, 2, 300, 128, 128, dtype=torch.bfloat16, device=GPU, h0=True,
                                   scalar_gate=scalar_gate)
    g = g.float()  # the gate kept in fp32, as models often do
    _check(q, k, v, g, beta, h0.float(), scale=128 ** -0.5, scalar_gate=scalar_gate, config=config)


@pytest.mark.gpu
@pytest.mark.parametrize("kd,bv,warps,layout", [(64, 64, 1, "kv"), (100, 32, 4, "kv"), (128, 16, 1, "kv"),
                                                (256, 16, 4, "kv"), (512, 32, 8, "kv"), (64, 64, 1, "vk"),
                                                (100, 32, 1, "vk"), (256, 16, 1, "vk"), (512, 8, 1, "vk")])
def test_gpu_wide_value_blocks(kd, bv, warps, layout):
    """REGISTERS_MODEL's wide blocks at ragged V (not a multiple of BLOCK_V), raw keys, an h0; both
    state-tile layouts."""
    q, k, v, g, beta, h0 = _inputs(14, 2, 3, 40, kd, 3 * bv - 5, dtype=torch.bfloat16, device=GPU, h0=True)
    _check(q, k, v, g, beta, h0, scale=kd ** -0.5,
           config={"VARIANT": "registers", "BLOCK_V": bv, "num_warps": warps, "STATE_LAYOUT": layout})


@pytest.mark.gpu
def test_gpu_ragged_strided_fp16():
    t, h, hv, kd, vd = 77, 3, 6, 100, 72
    q, k, v, g, beta, h0 = _inputs(11, h, hv // h, t, kd, vd, dtype=torch.float16, device=GPU, h0=True)
    qs = q.transpose(0, 1).contiguous().transpose(0, 1)  # [H, T, K] with strides of [T, H, K]
    vs = v.transpose(0, 1).contiguous().transpose(0, 1)
    for config in (None, {"VARIANT": "streamed", "BLOCK_K": 32}):
        _check(qs, k, vs, g, beta, h0, config=config, out_dtype=torch.bfloat16, tol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("kd", [8192, 16384])
def test_gpu_large_key_dim(kd):
    q, k, v, g, beta, h0 = _inputs(12, 2, 2, 12, kd, 64, dtype=torch.bfloat16, device=GPU, h0=True)
    assert kr.choose_config(k_dim=kd, v_dim=64, dtype=q.dtype, device=GPU, n_rows=4)["VARIANT"] == "streamed"
    _check(q, k, v, g, beta, h0, scale=kd ** -0.5)
    _check(q, k, v, g, beta, h0, scale=kd ** -0.5, final=False)


@pytest.mark.gpu
def test_gpu_new_length_does_not_recompile():
    for config in (REGS, STREAM16):
        mod = kr._module(config["VARIANT"], False, False, True, False)[1]
        for t in (5, 9, 33):
            q, k, v, g, beta, _ = _inputs(13, 1, 2, t, 24, 40, device=GPU)
            _check(q, k, v, g, beta, config=config)
            if t == 5:
                before = compiled_keys(mod.kda_recurrent_kernel)
        assert compiled_keys(mod.kda_recurrent_kernel) == before
