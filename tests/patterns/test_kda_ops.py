"""torch.ops.fuser.kda and its backward op as custom ops: schema, fake implementations and
autograd registration (torch.library.opcheck), the plan strings, and the layouts the op takes
(time axis anywhere, a loop that starts after t = 0)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fuser.patterns import kda_ops, kda_reference


def _args(t=6, b=1, h=2, k=8, v=12, seed=0, grad=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, h, k, generator=gen)
    kk = F.normalize(torch.randn(b, t, h, k, generator=gen), dim=-1)
    vv = torch.randn(b, t, h, v, generator=gen)
    g = -F.softplus(torch.randn(b, t, h, k, generator=gen))
    beta = torch.rand(b, t, h, generator=gen)
    xs = [q, kk, vv, g, beta]
    if grad:
        xs = [x.requires_grad_(True) for x in xs]
    return xs


def _call(q, k, v, g, beta, h0=None, t0=0, steps=None, plan="plan=recurrent", want_state=True):
    steps = q.shape[1] - t0 if steps is None else steps
    return torch.ops.fuser.kda(q, k, v, g, beta, h0, [1, 1, 1, 1, 1], t0, steps, 0.5, False, 1, v.dtype, want_state,
                               torch.float32, plan)


@pytest.mark.parametrize("plan", ["plan=recurrent", "plan=chunk;chunk=16"])
def test_opcheck_forward(plan):
    q, k, v, g, beta = _args()
    h0 = torch.randn(1, 2, 8, 12)
    torch.library.opcheck(torch.ops.fuser.kda.default,
                          (q, k, v, g, beta, h0, [1, 1, 1, 1, 1], 0, 6, 0.5, False, 1, torch.float32, True,
                           torch.float32, plan),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


def test_opcheck_backward():
    q, k, v, g, beta = _args()
    h0 = torch.randn(1, 2, 8, 12)
    d_o, d_s = torch.randn(1, 6, 2, 12), torch.randn(1, 2, 8, 12)
    torch.library.opcheck(torch.ops.fuser.kda_backward.default,
                          (q, k, v, g, beta, h0, d_o, d_s, [1, 1, 1, 1, 1], 0, 6, 0.5, False, 1),
                          test_utils=("test_schema", "test_faketensor"))


def test_a_loop_that_starts_later_reads_a_window_of_the_inputs():
    q, k, v, g, beta = _args(t=9)
    o, s = _call(q, k, v, g, beta, t0=3, steps=5)
    want_o, want_s = kda_reference.recurrent(q[:, 3:8], k[:, 3:8], v[:, 3:8], g[:, 3:8], beta[:, 3:8], scale=0.5,
                                             output_final_state=True)
    assert o.shape == (1, 5, 2, 12)
    torch.testing.assert_close(o.double(), want_o, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s.double(), want_s, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dim", [64, 300])  # the kernels' backward, then the float64 reference
def test_gradients_of_a_window_are_zero_outside_it(dim):
    q, k, v, g, beta = _args(t=7, k=dim if dim > 256 else 8, v=12, grad=True)
    o, s = _call(q, k, v, g, beta, t0=2, steps=4)
    (o.square().sum() + s.sum()).backward()
    ref = [x.detach().clone().requires_grad_(True) for x in (q, k, v, g, beta)]
    wo, ws = kda_reference.recurrent(*(x[:, 2:6] for x in ref), scale=0.5, output_final_state=True)
    (wo.square().sum() + ws.sum()).backward()
    for got, want in zip((q, k, v, g, beta), ref):
        assert got.grad[:, :2].abs().max() == 0 and got.grad[:, 6:].abs().max() == 0
        err = (got.grad.double() - want.grad.double()).norm() / want.grad.double().norm()
        assert err < 1e-4, err


GRAD_LAYOUTS = [
    # id, time dim of every input, scalar gate, beta [*L, 1] per step, h0, t0, steps of T, q/k/v dtype
    ("bhtf_scalar_gate_h0_window", 2, True, False, True, 3, 13, 19, torch.float32),
    ("bthf_beta_trailing_one_whole", 1, False, True, False, 0, 21, 21, torch.float32),
    ("tbhf_half_window", 0, False, False, True, 2, 15, 19, torch.float16),
]


@pytest.mark.parametrize("case", GRAD_LAYOUTS, ids=[c[0] for c in GRAD_LAYOUTS])
def test_gradients_in_the_inputs_layouts_poisoned(case):
    # the backward kernels write each gradient into a tensor allocated like its input (its shape,
    # strides and dtype), through a view of the loop's window; allocations poisoned (NaN): every
    # element in the window is written, every one outside it is exactly 0. B = 2, H = 3, K = 12,
    # V = 10 (T and steps no multiple of the chunk); float64 autograd through the recurrence is
    # the oracle
    from fuser.codegen import launch

    _, td, scalar_gate, beta_one, with_h0, t0, steps, t, dtype = case
    gen = torch.Generator().manual_seed(21)
    b, h, kd, vd = 2, 3, 12, 10
    q = torch.randn(b, t, h, kd, generator=gen)
    k = F.normalize(torch.randn(b, t, h, kd, generator=gen), dim=-1)
    v = torch.randn(b, t, h, vd, generator=gen)
    g = -F.softplus(torch.randn(b, t, h, *(() if scalar_gate else (kd,)), generator=gen))
    beta = torch.rand(b, t, h, *((1,) if beta_one else ()), generator=gen)
    h0 = torch.randn(b, h, kd, vd, generator=gen) if with_h0 else None
    xs = [_layout(x, td).to(dtype if i < 3 else torch.float32).requires_grad_(True)
          for i, x in enumerate((q, k, v, g, beta))]
    h0 = h0.requires_grad_(True) if with_h0 else None
    with launch.poison_outputs():
        o, s = torch.ops.fuser.kda(*xs, h0, [td] * 5, t0, steps, 0.5, scalar_gate, 1, torch.float32, True,
                                   torch.float32, "plan=chunk;chunk=16")
        d_o, d_s = torch.randn(o.shape, generator=gen), torch.randn(s.shape, generator=gen)
        torch.autograd.backward((o, s), (d_o, d_s))
    leaves = [x.detach().double().requires_grad_(True) for x in xs] + ([h0.detach().double().requires_grad_(True)]
                                                                         if with_h0 else [])
    fla = [x.movedim(td, 1)[:, t0:t0 + steps] for x in leaves[:5]]
    if scalar_gate:
        fla[3] = fla[3][..., None].expand(*fla[3].shape, kd)
    if beta_one:
        fla[4] = fla[4][..., 0]
    wo, ws = kda_reference.recurrent(*fla, scale=0.5, initial_state=leaves[5] if with_h0 else None,
                                     output_final_state=True)
    torch.autograd.backward((wo, ws), (d_o.double(), d_s.double()))
    tol = 1e-4 if dtype == torch.float32 else 3e-3
    for name, x, leaf in zip(("q", "k", "v", "g", "beta", "h0"), xs + ([h0] if with_h0 else []), leaves):
        got = x.grad
        assert got.shape == x.shape and got.dtype == x.dtype and got.stride() == x.stride(), name
        assert not got.isnan().any(), f"{name}: an element of the gradient was never written"
        if name != "h0":
            outside = torch.ones(x.shape[td], dtype=torch.bool)
            outside[t0:t0 + steps] = False
            assert (got.index_select(td, outside.nonzero()[:, 0]) == 0).all(), f"{name}: nonzero outside the window"
        err = (got.double() - leaf.grad).norm() / leaf.grad.norm()
        assert err < tol, f"{name}: relative error {err:.3g}"


@pytest.mark.parametrize("plan", ["plan=chunk;chunk=16", "plan=recurrent"])
def test_gradients_of_inputs_that_are_views_with_gaps_broadcasts_or_aliases(plan):
    # the gradients are allocated like the inputs (empty_like): inputs that are not dense views
    # of their own memory get dense gradients that autograd routes back. q, k, v sliced out of one
    # fused projection [B, T, H, 2K + V] (strides with gaps); k the same tensor as q in one case;
    # beta a [B, T, 1] broadcast over the heads (stride 0). float64 autograd through the
    # recurrence is the oracle, on the leaves (the projection, beta's [B, T, 1])
    from fuser.codegen import launch

    gen = torch.Generator().manual_seed(5)
    b, t, h, kd, vd = 2, 19, 3, 12, 10
    proj = (torch.randn(b, t, h, 2 * kd + vd, generator=gen) * 0.3).requires_grad_(True)
    g0 = (-F.softplus(torch.randn(b, t, h, kd, generator=gen))).requires_grad_(True)
    b0 = torch.rand(b, t, 1, generator=gen).requires_grad_(True)

    def inputs(p, gl, bl, alias):
        q, k, v = p[..., :kd], p[..., kd:2 * kd], p[..., 2 * kd:]
        return q, (q if alias else k), v, gl, bl.expand(b, t, h)

    for alias in (False, True):
        for x in (proj, g0, b0):
            x.grad = None
        q, k, v, g, beta = inputs(proj, g0, b0, alias)
        assert not q.is_contiguous() and beta.stride(-1) == 0
        with launch.poison_outputs():
            o, st = torch.ops.fuser.kda(q, k, v, g, beta, None, [1] * 5, 0, t, 0.5, False, 1, torch.float32, True,
                                        torch.float32, plan)
            d_o, d_s = torch.randn(o.shape, generator=gen), torch.randn(st.shape, generator=gen)
            torch.autograd.backward((o, st), (d_o, d_s))
        leaves = [x.detach().double().requires_grad_(True) for x in (proj, g0, b0)]
        wo, ws = kda_reference.recurrent(*inputs(*leaves, alias), scale=0.5, output_final_state=True)
        torch.autograd.backward((wo, ws), (d_o.double(), d_s.double()))
        for name, x, leaf in zip(("proj", "g", "beta"), (proj, g0, b0), leaves):
            assert not x.grad.isnan().any(), (alias, name)
            err = (x.grad.double() - leaf.grad).norm() / leaf.grad.norm()
            assert err < 1e-4, (alias, name, float(err))


def test_plan_strings():
    defaults = {"dots": "float32", "output_precision": None, "save": "inputs"}
    assert kda_ops.plan_string("chunk", 32) == "plan=chunk;chunk=32"
    assert kda_ops.parse_plan(kda_ops.plan_string("chunk", 32)) == {"plan": "chunk", "chunk": 32, **defaults}
    assert kda_ops.parse_plan("") == {"plan": "recurrent", "chunk": 64, **defaults}
    # the chunked kernels' dots: workspaces' dtype and the output path's input_precision
    text = kda_ops.plan_string("chunk", 64, dots="bfloat16", output_precision="ieee")
    assert text == "plan=chunk;chunk=64;dots=bfloat16;output_precision=ieee"
    assert kda_ops.parse_plan(text) == {"plan": "chunk", "chunk": 64, "dots": "bfloat16", "output_precision": "ieee",
                                        "save": "inputs"}
    # what the chunk plan keeps for its backward (op fuser::kda_save)
    text = kda_ops.plan_string("chunk", 64, save="workspaces")
    assert text == "plan=chunk;chunk=64;save=workspaces" and kda_ops.parse_plan(text)["save"] == "workspaces"
    with pytest.raises(ValueError, match="save='all': expected one of"):
        kda_ops.parse_plan("plan=chunk;save=all")
    with pytest.raises(ValueError, match="only the chunk plan"):
        kda_ops.parse_plan("plan=recurrent;save=workspaces")
    assert kda_ops.parse_plan(kda_ops.plan_string("chunk", 64, output_precision="tf32"))["output_precision"] == "tf32"
    assert kda_ops.plan_string("recurrent", 64, dots="bfloat16") == "plan=recurrent"  # the chunk plan's only
    with pytest.raises(ValueError, match="expected one of plan=, chunk=, dots=, output_precision=, save="):
        kda_ops.parse_plan("plan=chunk;block=4")
    with pytest.raises(ValueError, match="expected one of"):
        kda_ops.parse_plan("plan=scan")
    with pytest.raises(ValueError, match=r"dots='float16': expected one of \('float32', 'bfloat16'\)"):
        kda_ops.parse_plan("plan=chunk;dots=float16")
    with pytest.raises(ValueError, match=r"output_precision='tf32x6': expected one of \('tf32', 'tf32x3', 'ieee'\)"):
        kda_ops.parse_plan("plan=chunk;output_precision=tf32x6")


@pytest.mark.parametrize("precision", ["tf32", "tf32x3", "ieee"])
def test_the_chunk_plans_output_precision_reaches_the_kernels(precision):
    # the op passes the plan's output_precision to codegen/kda_chunk.forward: its kernel variant is
    # rendered (the interpreter computes plain float32 products whatever it says: the same values)
    from fuser.codegen.render import rendered_kernels

    q, k, v, g, beta = _args(t=20)
    o, s = _call(q, k, v, g, beta, plan=f"plan=chunk;chunk=16;output_precision={precision}")
    names = {x.name for x in rendered_kernels()}
    assert f"kda_chunk_prep_strips_c16_o{precision}_interp" in names  # the interpreter's default variant
    assert any(n.startswith("kda_chunk_scan_c16_kb") and n.endswith(f"_o{precision}_interp") for n in names)
    want_o, want_s = kda_reference.recurrent(q, k, v, g, beta, scale=0.5, output_final_state=True)
    torch.testing.assert_close(o.double(), want_o, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s.double(), want_s, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("plan", ["plan=recurrent", "plan=chunk;chunk=16", "plan=parallel"])
def test_a_gate_of_minus_infinity_resets_the_state(plan):
    # exp(-inf) = 0: eager's state restarts there; the chunked forms difference cumulative sums
    q, k, v, g, beta = _args(t=20, grad=True)
    with torch.no_grad():
        g[:, 5, :, :3] = float("-inf")
        g[:, 11] = float("-inf")
    o, s = _call(q, k, v, g, beta, plan=plan)
    want_o, want_s = kda_reference.recurrent(q, k, v, g, beta, scale=0.5, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    torch.testing.assert_close(o.double(), want_o, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s.double(), want_s, rtol=1e-4, atol=1e-5)
    if plan != "plan=parallel":
        (o.square().sum() + s.sum()).backward()
        assert all(torch.isfinite(x.grad).all() for x in (q, k, v, g, beta))
        # the backward kernels floor the gates as they load them: the gradients are eager's (a −inf
        # gate's own dg is 0 there, as exp's gradient at −inf)
        ref = [x.detach().double().requires_grad_(True) for x in (q, k, v, g, beta)]
        ro, rs = kda_reference.recurrent(*ref, scale=0.5, output_final_state=True)
        (ro.square().sum() + rs.sum()).backward()
        for got, want in zip((q, k, v, g, beta), ref):
            torch.testing.assert_close(got.grad.double(), want.grad, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------------------------
# The op's output: allocated in its final layout, written by the kernels in place
# --------------------------------------------------------------------------------------------

PLANS = ["plan=recurrent", "plan=chunk;chunk=16", "plan=parallel"]


def _layout(x: torch.Tensor, time_dim: int) -> torch.Tensor:
    """``x`` ``[B, T, H, *]`` with its time axis moved to ``time_dim`` (a copy: contiguous)."""
    return x.movedim(1, time_dim).contiguous()


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("in_dim,out_dim", [(1, 1), (1, 2), (2, 1), (2, 0), (0, 2)],
                         ids=["bthv_to_bthv", "bthv_to_bhtv", "bhtv_to_bthv", "bhtv_to_tbhv", "tbhv_to_bhtv"])
def test_outputs_in_every_layout(plan, in_dim, out_dim):
    # B = 2, H = 3: o [B, T, H, V] has rows b H + h in two stride groups; T = 21 is no multiple of
    # the chunk; o poisoned (NaN) when allocated, so an element the kernels miss shows up
    from fuser.codegen import launch

    q, k, v, g, beta = _args(t=21, b=2, h=3, k=8, v=12, seed=3)
    ins = [_layout(x, in_dim) for x in (q, k, v, g, beta)]
    h0 = torch.randn(2, 3, 8, 12)
    with launch.poison_outputs():
        o, s = torch.ops.fuser.kda(*ins, h0, [in_dim] * 5, 0, 21, 0.5, False, out_dim, torch.float32, True,
                                   torch.float32, plan)
    want_o, want_s = kda_reference.recurrent(q, k, v, g, beta, scale=0.5, initial_state=h0, output_final_state=True)
    assert o.shape == want_o.movedim(1, out_dim).shape and o.is_contiguous() and o.dtype == torch.float32
    torch.testing.assert_close(o.double(), want_o.movedim(1, out_dim), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s.double(), want_s, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("plan", PLANS)
def test_half_outputs_and_a_window(plan):
    # o in float16 from float32 inputs, of steps 2..17 of 20, [B, H, T, V] out of [B, T, H, *]
    q, k, v, g, beta = _args(t=20, b=2, h=2, k=8, v=12, seed=4)
    o, s = torch.ops.fuser.kda(q, k, v, g, beta, None, [1] * 5, 2, 15, 0.5, False, 2, torch.float16, False,
                               torch.float32, plan)
    want_o, _ = kda_reference.recurrent(*(x[:, 2:17] for x in (q, k, v, g, beta)), scale=0.5)
    assert o.dtype == torch.float16 and o.shape == (2, 2, 15, 12) and o.is_contiguous() and s.numel() == 0
    torch.testing.assert_close(o.double(), want_o.movedim(1, 2), rtol=5e-3, atol=5e-3)


def test_inputs_without_lead_dims():
    # q [T, K]: one row, no batch or head dims
    q, k, v, g, beta = (x[0, :, 0] for x in _args(t=9, b=1, h=1, seed=5))
    for plan in PLANS:
        o, s = torch.ops.fuser.kda(q, k, v, g, beta, None, [0] * 5, 0, 9, 0.5, False, 0, torch.float32, True,
                                   torch.float32, plan)
        want_o, want_s = kda_reference.recurrent(q[None, :, None], k[None, :, None], v[None, :, None],
                                                 g[None, :, None], beta[None, :, None], scale=0.5,
                                                 output_final_state=True)
        assert o.shape == (9, 12) and s.shape == (8, 12)
        torch.testing.assert_close(o.double(), want_o[0, :, 0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(s.double(), want_s[0, 0], rtol=1e-4, atol=1e-5)


def test_opcheck_forward_in_a_heads_first_layout():
    q, k, v, g, beta = (_layout(x, 2) for x in _args(t=6, b=2, h=2))
    torch.library.opcheck(torch.ops.fuser.kda.default,
                          (q, k, v, g, beta, None, [2] * 5, 0, 6, 0.5, False, 1, torch.float32, False,
                           torch.float32, "plan=chunk;chunk=16"),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


@pytest.mark.parametrize("plan", ["plan=chunk;chunk=16", "plan=parallel"])
def test_the_gates_are_floored_by_the_kernels_not_before_them(plan, monkeypatch):
    # no clamp_min (an extra kernel on the GPU) on the forward path; -inf gates still reset
    q, k, v, g, beta = _args(t=20, b=2, seed=6)
    g[:, 5, :, :3] = float("-inf")
    g[:, 11] = float("-inf")

    def no_clamp(*args, **kwargs):
        raise AssertionError("clamp_min called on the forward path")

    monkeypatch.setattr(torch.Tensor, "clamp_min", no_clamp)
    monkeypatch.setattr(torch, "clamp_min", no_clamp)
    o, s = _call(q, k, v, g, beta, plan=plan)
    monkeypatch.undo()
    want_o, want_s = kda_reference.recurrent(q, k, v, g, beta, scale=0.5, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    torch.testing.assert_close(o.double(), want_o, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s.double(), want_s, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("plan", PLANS)
def test_a_nan_gate_is_nan_where_eagers_is(plan):
    # as torch's clamp_min keeps NaN, the kernels' floor does: o is NaN wherever eager's is (the
    # head of the NaN gate from its step on), and the other heads equal eager's
    q, k, v, g, beta = _args(t=20, b=1, h=2, seed=7)
    g[0, 9, 1, 2] = float("nan")
    o, s = _call(q, k, v, g, beta, plan=plan)
    want_o, want_s = kda_reference.recurrent(q, k, v, g, beta, scale=0.5, output_final_state=True)
    assert want_o[0, 9:, 1].isnan().all() and o[0, 9:, 1].isnan().all() and s[0, 1].isnan().any()
    assert not o[:, :, 0].isnan().any()
    torch.testing.assert_close(o[:, :, 0].double(), want_o[:, :, 0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s[:, 0].double(), want_s[:, 0], rtol=1e-4, atol=1e-5)
    if plan == "plan=recurrent":  # step by step: the steps before the NaN are eager's too
        torch.testing.assert_close(o[0, :9, 1].double(), want_o[0, :9, 1], rtol=1e-4, atol=1e-5)


def test_plan_strings_are_parsed_once():
    text = "plan=chunk;chunk=32;dots=bfloat16"
    assert kda_ops._parsed_plan(text) is kda_ops._parsed_plan(text)
    assert kda_ops._parsed_plan(text) == kda_ops.parse_plan(text)
    mine = kda_ops.parse_plan(text)
    mine["chunk"] = 7  # parse_plan's dicts are the caller's: the cached one is untouched
    assert kda_ops._parsed_plan(text)["chunk"] == 32
    with pytest.raises(ValueError, match="expected one of"):
        kda_ops._parsed_plan("plan=scan")
    with pytest.raises(ValueError, match="expected one of"):  # errors are not cached away
        _call(*_args(), plan="plan=scan")


# --------------------------------------------------------------------------------------------
# As Inductor sees the op on the GPU (launch.inline_into_inductor), traced on the CPU
# --------------------------------------------------------------------------------------------


@pytest.fixture
def as_on_an_h100(monkeypatch):
    """Trace the op as on an H100 with "meta" tensors standing for CUDA ones (as
    tests/patterns/test_inline_ops.py does): config tables answer as on the H100, the op is
    inlined, Triton's analysis of the kernels compiles them to TTIR for sm90."""
    import triton
    from triton.backends.compiler import GPUTarget

    from fuser.codegen import launch

    class _H100Driver:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    monkeypatch.setattr(launch, "device_properties",
                        lambda index: {"name": "NVIDIA H100 80GB HBM3", "sm_count": 132, "capability": (9, 0)})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(launch, "INLINE_INTO_INDUCTOR", True)
    monkeypatch.setattr(launch, "INLINE_DEVICE_TYPES", ("cuda", "meta"))
    monkeypatch.setattr(triton.runtime.driver, "_active", _H100Driver())


VIEWS = {"aten.permute.default", "aten.view.default", "aten.unsqueeze.default", "aten.squeeze.dim",
         "aten._unsafe_view.default", "aten.reshape.default", "aten.as_strided.default", "aten.alias.default"}


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("b,out_dim", [(1, 1), (2, 1), (2, 2)], ids=["B1_bthv", "B2_bthv", "B2_bhtv"])
def test_inlined_op_writes_o_in_place(as_on_an_h100, plan, b, out_dim):
    # the kernels write o where the op returns it: between the last kernel launch and the graph's
    # output o passes through views only (no clone, no copy), and no clamp_min runs before them
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch._subclasses.functional_tensor import dispatch_functionalize
    from torch.fx.experimental.proxy_tensor import make_fx

    t, h, kd, vd = 40, 2, 32, 48
    real = [torch.empty(b, t, h, kd, dtype=torch.bfloat16), torch.empty(b, t, h, kd, dtype=torch.bfloat16),
            torch.empty(b, t, h, vd, dtype=torch.bfloat16), torch.empty(b, t, h, kd), torch.empty(b, t, h)]
    mode = FakeTensorMode()
    with mode:
        fake = [torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta") for x in real]
    rest = (None, [1] * 5, 0, t, kd ** -0.5, False, out_dim, torch.bfloat16, False, torch.float32, plan)
    op = torch.ops.fuser.kda.default
    with mode:
        gm = make_fx(dispatch_functionalize(lambda *xs: op(*xs, *rest)))(*fake)
        got, expect = gm(*fake), op(*fake, *rest)
    assert got[0].shape == expect[0].shape and got[0].stride() == expect[0].stride()
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert any("triton_kernel_wrapper_functional" in x for x in targets), targets
    assert not any("clamp" in x or x.startswith("fuser.") for x in targets), targets
    if b == 1:  # the inputs are views too: nothing but the kernels and allocations
        assert not any("clone" in x or "copy" in x for x in targets), targets
    node = next(n for n in gm.graph.nodes if n.op == "output").args[0][0]
    while not (node.op == "call_function" and str(node.target) == "<built-in function getitem>"):
        assert node.op == "call_function" and str(node.target) in VIEWS, (node.target, targets)
        node = node.args[0]
    assert "triton_kernel_wrapper_functional" in str(node.args[0].target)


# --------------------------------------------------------------------------------------------
# No copies of the inputs: the recurrent and chunk kernels read [*L, T, *] views in place
# --------------------------------------------------------------------------------------------


class _InputCopies:
    """A ``TorchDispatchMode`` that runs the bodies of ``fuser::kda`` and ``fuser::kda_backward``
    (their Python implementations, so that their own tensor ops reach the mode) and records every
    op that copies data out of one of their tensor arguments (``copy_`` from it, ``clone``,
    ``_to_copy``, ``clamp_min``, a ``reshape`` / ``contiguous`` that is not a view) into
    ``copies``, and every such op inside the bodies whose source is none of their arguments (a
    copy of what the kernels wrote: a gradient moved into its input's layout) into
    ``result_copies``. Ops inside a kernel launch (Triton's interpreter copies the arguments it
    is given) are not counted."""

    COPYING = {"aten.copy_.default", "aten.clone.default", "aten._to_copy.default", "aten.clamp_min.default",
               "aten.reshape.default", "aten.contiguous.default", "aten._reshape_copy.default"}

    def __init__(self, monkeypatch):
        from torch.utils._python_dispatch import TorchDispatchMode

        from fuser.codegen import launch

        impls = {"fuser.kda.default": kda_ops.kda._init_fn, "fuser.kda_backward.default": kda_ops.kda_backward._init_fn}
        outer = self
        self.copies: list[str] = []
        self.result_copies: list[str] = []
        self.sources: set = set()
        self.paused = False
        self.inside = False
        real = launch.interpreter_mode

        import contextlib

        @contextlib.contextmanager
        def interpreting():
            outer.paused, before = True, outer.paused
            try:
                with real():
                    yield
            finally:
                outer.paused = before

        monkeypatch.setattr(launch, "interpreter_mode", interpreting)

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                name = str(func)
                if name in impls:
                    outer.sources = {x.untyped_storage().data_ptr() for x in args if isinstance(x, torch.Tensor)}
                    outer.inside, before = True, outer.inside
                    try:
                        with self:
                            return impls[name](*args, **kwargs)
                    finally:
                        outer.inside = before
                out = func(*args, **kwargs)
                if not outer.paused and name in outer.COPYING:
                    src = args[1] if name == "aten.copy_.default" else args[0]
                    res = args[0] if name == "aten.copy_.default" else out
                    if (isinstance(src, torch.Tensor) and isinstance(res, torch.Tensor)
                            and res.untyped_storage().data_ptr() != src.untyped_storage().data_ptr()):
                        if src.untyped_storage().data_ptr() in outer.sources:
                            outer.copies.append(name)
                        elif outer.inside:
                            outer.result_copies.append(name)
                return out

        self.mode = Mode()


@pytest.mark.parametrize("plan", ["plan=recurrent", "plan=chunk;chunk=16", "plan=parallel"])
@pytest.mark.parametrize("in_dim", [1, 2])
def test_the_inputs_are_not_copied(plan, in_dim, monkeypatch):
    # B = 2 [B, T, H, *] (in_dim 1: two stride groups per input) and [B, H, T, *] (in_dim 2), a
    # window t0 = 2: neither the forward nor the backward op copies q, k, v, g, beta or dO, nor
    # what its kernels wrote (the backward kernels write the gradients in the inputs' layouts)
    if not hasattr(kda_ops.kda, "_init_fn"):
        pytest.skip("this torch's custom_op keeps no _init_fn")
    xs = [_layout(x, in_dim).detach().requires_grad_(True) for x in _args(t=19, b=2, h=3, seed=8)]
    count = _InputCopies(monkeypatch)
    with count.mode:
        o, s = torch.ops.fuser.kda(*xs, None, [in_dim] * 5, 2, 17, 0.5, False, 1, torch.float32, True,
                                   torch.float32, plan)
    assert count.copies == [] and count.result_copies == [], (count.copies, count.result_copies)
    d_o, d_s = torch.randn(o.shape), torch.randn(s.shape)
    with count.mode:
        torch.autograd.backward((o, s), (d_o, d_s))
    assert count.copies == [] and count.result_copies == [], (count.copies, count.result_copies)
    # the counter sees copies: lead dims in three stride groups (a broadcast dim between batch and
    # heads: [B, T, 2, H, *] with stride 0) make the launchers copy each of the five inputs once
    if in_dim == 1:
        xs3 = [x.detach().unsqueeze(2).expand(x.shape[0], x.shape[1], 2, *x.shape[2:]) for x in xs]
        with count.mode:
            torch.ops.fuser.kda(*xs3, None, [1] * 5, 2, 17, 0.5, False, 1, torch.float32, False, torch.float32, plan)
        assert len(count.copies) == 5 and count.result_copies == [], (count.copies, count.result_copies)
        # dense inputs whose lead dims are three stride groups ([B, T, 2, H, *] stored [H, 2, B, T, *]):
        # the backward copies the five inputs, and its kernels write the five gradients (allocated
        # like the inputs) through temporaries, copied in
        xs3 = [x.detach().unsqueeze(2).expand(x.shape[0], x.shape[1], 2, *x.shape[2:]).permute(3, 2, 0, 1, *range(4, x.dim() + 1))
               .contiguous().permute(2, 3, 1, 0, *range(4, x.dim() + 1)).requires_grad_(True) for x in xs]
        assert all(x.stride(2) > x.stride(0) and not x.is_contiguous() for x in xs3)
        with count.mode:
            o3, s3 = torch.ops.fuser.kda(*xs3, None, [1] * 5, 2, 17, 0.5, False, 1, torch.float32, True,
                                         torch.float32, plan)
        count.copies.clear()
        with count.mode:
            torch.autograd.backward((o3, s3), (torch.randn(o3.shape), torch.randn(s3.shape)))
        assert len(count.copies) == 5 and count.result_copies == ["aten.copy_.default"] * 5, (
            count.copies, count.result_copies)
        assert all(x.grad.stride() == x.stride() for x in xs3)
    # and the results are right (against the float64 reference, forward and backward)
    ref = [x.detach().clone().requires_grad_(True) for x in xs]
    fla = [x.movedim(in_dim, 1)[:, 2:19] for x in ref]
    want_o, want_s = kda_reference.recurrent(*fla, scale=0.5, output_final_state=True)
    torch.testing.assert_close(o.double(), want_o, rtol=1e-4, atol=1e-5)
    torch.autograd.backward((want_o, want_s), (d_o.double(), d_s.double()))
    for got, exp in zip(xs, ref):
        err = (got.grad.double() - exp.grad.double()).norm() / exp.grad.double().norm()
        assert err < 1e-4, err
