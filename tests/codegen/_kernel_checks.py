"""Checks shared by the kernel test modules: relative errors, random masks, config tables,
compiled specialisations."""

import math

import pytest
import torch
import torch.nn.functional as F

from fuser.codegen import kda_recurrent, launch
from fuser.patterns.kda_reference import recurrent


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``‖a − b‖ / ‖b‖`` in float64 (``‖a − b‖`` when ``b`` is all zeros)."""
    a, b = a.double(), b.double()
    den = b.norm().item()
    num = (a - b).norm().item()
    return num / den if den > 0 else num


def random_mask(kind: str, row_shape: tuple, full_shape: tuple, row: bool, gen: torch.Generator):
    """A random mask of ``kind`` (``"none"``: None; ``"additive"``: normal floats; boolean kinds:
    ~70% True), shaped ``row_shape`` (one row broadcast over queries) if ``row`` else ``full_shape``."""
    if kind == "none":
        return None
    shape = row_shape if row else full_shape
    if kind == "additive":
        return torch.randn(*shape, generator=gen)
    return torch.rand(*shape, generator=gen) > 0.3


def check_table(fwd: dict, bwd: dict) -> None:
    """Every (device kind, head-dim bucket, dtype size) has candidates, and each candidate has
    power-of-two blocks >= 16 (``launch.check_config``), 1..8 warps and >= 1 stage."""
    for dev in ("sm90", "cuda"):
        for bucket in (64, 128, 256):
            for size in (2, 4):
                for table, keys in ((fwd, ("BLOCK_M", "BLOCK_N")), (bwd, ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2"))):
                    cands = table[(dev, bucket, size)]
                    assert cands
                    for c in cands:
                        assert all(key in c for key in keys)
                        launch.check_config(c)
                        assert c["num_warps"] in (1, 2, 4, 8) and c["num_stages"] >= 1


def compiled_keys(fn) -> set:
    """The specialisation keys a @triton.jit function has compiled on the device so far (to
    check that new sequence lengths do not recompile); skips the test on a Triton that keeps no
    ``device_caches``."""
    import pytest

    if not hasattr(fn, "device_caches"):
        pytest.skip("this Triton keeps no device_caches")
    return {key for entry in fn.device_caches.values() for key in entry[0]}


# -- KDA forward launchers (codegen/kda_recurrent.py, codegen/kda_parallel.py) --------------------

KDA_TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
CPU = torch.device("cpu")


def kda_inputs(seed, nq, group, t, kd, vd, *, dtype=torch.float32, device=CPU, scalar_gate=False, h0=False,
               l2=True, strong_decay=False):
    """Fresh random inputs in the kernels' layout: q, k [NQ, T, K], v [N, T, V], g, beta, h0."""
    gen = torch.Generator().manual_seed(seed)
    n = nq * group
    q = torch.randn(nq, t, kd, generator=gen)
    k = torch.randn(nq, t, kd, generator=gen)
    if l2:
        k = F.normalize(k, dim=-1)
    v = torch.randn(n, t, vd, generator=gen)
    g = -F.softplus(torch.randn(*((n, t) if scalar_gate else (n, t, kd)), generator=gen))
    if strong_decay:  # some gates near -30: the state is all but wiped there
        g = torch.where(torch.rand(g.shape, generator=gen) < 0.2, torch.full_like(g, -30.0), g)
    beta = torch.rand(n, t, generator=gen)
    s0 = torch.randn(n, kd, vd, generator=gen) if h0 else None
    out = [x.to(device=device, dtype=dtype) for x in (q, k, v, g, beta)]
    return (*out, None if s0 is None else s0.to(device=device, dtype=dtype))


def kda_eager_loop(q, k, v, g, beta, scale, dt):
    """FLA's naive loop on [N, T, *] (one q/k row per value row): ``(o, final state)``, the state in
    ``dt``, each step's slices upcast to ``dt`` (the eager loop a user writes, for error baselines)."""
    n, t, kd = q.shape
    s = torch.zeros(n, kd, v.shape[-1], dtype=dt, device=q.device)
    o = torch.empty(n, t, v.shape[-1], dtype=dt, device=q.device)
    for i in range(t):
        q_t, k_t, v_t = q[:, i].to(dt), k[:, i].to(dt), v[:, i].to(dt)
        s = s * g[:, i].to(dt).exp()[..., None]
        v_hat = (k_t[..., None] * s).sum(-2)
        s = s + (beta[:, i].to(dt)[:, None] * k_t)[..., None] * (v_t - v_hat)[:, None, :]
        o[:, i] = (q_t[..., None] * s).sum(-2) * scale
    return o, s


def kda_strided_views(seed, t, h, hv, kd, vd):
    """Fresh inputs in FLA's ``[B, T, H, *]`` layout viewed as ``[H, T, *]`` (B = 1: views, no
    copy): keys with a channel stride of 2, beta ``[T, N]`` transposed, h0 ``[N, V, K]``
    transposed; q/k/v float16 with g, beta, h0 float32; ``hv // h`` value heads per q/k head.
    Returns ``(q, k, v, g, beta, h0)``, none of them contiguous."""
    q, k, v, g, beta, h0 = kda_inputs(seed, h, hv // h, t, kd, vd, h0=True)
    q_b = q.transpose(0, 1).contiguous()[None].half()                    # [1, T, H, K]
    k_wide = torch.zeros(1, t, h, 2 * kd, dtype=torch.float16)
    k_wide[..., ::2] = k.transpose(0, 1)[None].half()
    v_b = v.transpose(0, 1).contiguous()[None].half()                    # [1, T, HV, V]
    g_b = g.transpose(0, 1).contiguous()[None]                           # [1, T, HV, K] fp32
    beta_tn = beta.t().contiguous()                                      # [T, N] fp32
    h0_vk = h0.transpose(1, 2).contiguous()                              # [N, V, K]
    qs, ks = q_b[0].transpose(0, 1), k_wide[0, ..., ::2].transpose(0, 1)
    vs, gs = v_b[0].transpose(0, 1), g_b[0].transpose(0, 1)
    bs, hs = beta_tn.t(), h0_vk.transpose(1, 2)
    assert not any(x.is_contiguous() for x in (qs, ks, vs, gs, bs, hs)) and ks.stride(-1) == 2
    assert qs.data_ptr() == q_b.data_ptr() and ks.data_ptr() == k_wide.data_ptr()  # views, no copy
    return qs, ks, vs, gs, bs, hs


def kda_reference_rows(q, k, v, g, beta, scale, h0, scalar_gate):
    """patterns/kda_reference.recurrent on the kernels' layout (one batch; heads = rows): o [N, T, V],
    final state [N, K, V], float64."""
    n, t, vd = v.shape
    kd = q.shape[-1]
    if scalar_gate:
        g = g[..., None].expand(n, t, kd)
    to4 = lambda x: x.transpose(0, 1)[None]  # [rows, T, *] -> [1, T, rows, *]
    o, s = recurrent(to4(q), to4(k), to4(v), to4(g), beta.transpose(0, 1)[None], scale=scale,
                     initial_state=None if h0 is None else h0[None], output_final_state=True)
    return o[0].transpose(0, 1), s[0]


def check_kda_forward(forward, q, k, v, g, beta, h0=None, *, scale=0.3, scalar_gate=False, final=True, config=None,
                      out_dtype=None, tol=None):
    """``forward`` (a KDA forward launcher: codegen/kda_recurrent.py, kda_parallel.py) with poisoned
    outputs against the float64 reference; returns (o, final state)."""
    tol = KDA_TOL[q.dtype] if tol is None else tol
    with launch.poison_outputs():
        o, s = forward(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=final,
                          scalar_gate=scalar_gate, out_dtype=out_dtype, config=config)
    ref_o, ref_s = kda_reference_rows(q, k, v, g, beta, scale, h0, scalar_gate)
    assert o.shape == v.shape and o.dtype == (out_dtype or v.dtype) and o.is_contiguous()
    assert not o.isnan().any(), "an output element was never written"
    err = rel_err(o, ref_o)
    assert err < tol, f"o: relative error {err:.3g} >= {tol}"
    if final:
        assert s.shape == (v.shape[0], q.shape[-1], v.shape[-1]) and s.dtype == torch.float32 and s.is_contiguous()
        assert not s.isnan().any(), "a final-state element was never written"
        err = rel_err(s, ref_s)
        assert err < tol, f"final state: relative error {err:.3g} >= {tol}"
    else:
        assert s is None
    return o, s


# --------------------------------------------------------------------------------------------
# KDA forward launchers' out=: o preallocated in the caller's layout
# --------------------------------------------------------------------------------------------

def kda_out_layouts(t, vd, dtype):
    """KDA forward launchers' ``out=`` tensors for N = 8 rows (b, h) = (2, 4), poisoned (NaN): (name, out, lead groups
    the kernels address, i.e. how many stride groups; 0: the copy fallback)."""
    b, h = 2, 4
    wide = torch.full((b, t, h, vd + 3), float("nan"), dtype=dtype)
    return [
        ("contiguous", torch.full((b * h, t, vd), float("nan"), dtype=dtype), 1),
        ("b_t_h_v", torch.full((b, t, h, vd), float("nan"), dtype=dtype).movedim(1, 2), 2),     # the op's o, out_dim=1
        ("b_h_t_v", torch.full((b, h, t, vd), float("nan"), dtype=dtype), 1),                     # out_dim=2
        ("t_b_h_v", torch.full((t, b, h, vd), float("nan"), dtype=dtype).movedim(0, 2), 1),     # out_dim=0
        ("padded_rows", wide[..., :vd].movedim(1, 2), 2),                               # columns past V untouched
        ("value_stride_2", torch.full((b, t, h, 2 * vd), float("nan"), dtype=dtype)[..., ::2].movedim(1, 2), 2),
        # lead dims [2, 2, 2] none of which merge: written through a temporary and copied
        ("three_groups", torch.full((2, 2, 2, t, vd), float("nan"), dtype=dtype).permute(2, 1, 0, 3, 4), 0),
    ]


def check_kda_out(forward, q, k, v, g, beta, h0, *, tol, **kw):
    """``forward(..., out=out)`` for every layout of :func:`_out_layouts`: writes ``out`` in place
    (returns it), every element of it, as the float64 reference says; nothing outside it."""
    n, t, vd = v.shape
    scale = 0.3
    ref_o, ref_s = kda_reference_rows(q, k, v, g, beta, scale, h0, kw.get("scalar_gate", False))
    for name, out, groups in kda_out_layouts(t, vd, kw.pop("out_dtype", v.dtype)):
        assert (kda_recurrent.row_groups(out.shape[:-2], out.stride()[:-2]) is None) == (groups == 0), name
        base = out._base if out._base is not None else out
        before = base.clone()
        with launch.poison_outputs():
            o, s = forward(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True,
                           out_dtype=out.dtype, out=out, **kw)
        assert o is out, name
        assert not o.isnan().any(), f"{name}: an element of out was never written"
        rows = o.reshape(n, t, vd)
        err = rel_err(rows, ref_o)
        assert err < tol, f"{name}: o relative error {err:.3g} >= {tol}"
        assert rel_err(s, ref_s) < tol, name
        # the memory of the base outside out is as it was (NaN)
        written = torch.zeros(base.shape, dtype=torch.bool)
        written.as_strided(out.shape, out.stride(), out.storage_offset()).fill_(True)
        assert base[~written].isnan().all() and before[~written].isnan().all(), name


def check_kda_out_no_tokens(forward, q, k, v, g, beta, **kw):
    """``forward`` on T = 0 inputs (``v`` ``[N, 0, V]``, N even) with ``out`` a ``[2, N/2, 0, V]``
    view (``[B, T, H, V]`` with its time axis moved): nothing to launch, ``out`` itself returned."""
    n, t, vd = v.shape
    assert t == 0 and n % 2 == 0
    out = torch.empty(2, 0, n // 2, vd).movedim(1, 2)
    o, _ = forward(q, k, v, g, beta, scale=0.5, out=out, **kw)
    assert o is out


def check_kda_bad_out(forward, q, k, v, g, beta, **kw):
    n, t, vd = v.shape
    cases = [
        (torch.empty(n, t + 1, vd), r"out must be \[N, T, V\]"),
        (torch.empty(n, t, vd + 1), r"out must be \[N, T, V\]"),
        (torch.empty(n + 1, t, vd), r"prod\(lead\) = N"),
        (torch.empty(t, vd), r"out must be \[N, T, V\]"),
        (torch.empty(n, t, vd, dtype=torch.float16), r"out has dtype torch.float16"),
        (torch.empty(n, t, vd, device="meta"), r"out is on meta"),
        (torch.empty(1, t, vd).expand(n, t, vd), r"out overlaps itself"),
        (torch.empty(n, t, vd).tolist(), r"out must be a torch.Tensor"),
    ]
    for out, match in cases:
        with pytest.raises(ValueError, match=match):
            forward(q, k, v, g, beta, scale=0.5, out=out, **kw)


# --------------------------------------------------------------------------------------------
# KDA launchers' inputs with lead dims ([*lead, T, *]: rows as stride groups, no copy)
# --------------------------------------------------------------------------------------------

#: Layouts of :func:`kda_lead_layout`, and whether the launchers read them in place.
KDA_LEAD_LAYOUTS = {"bthf": True, "bhtf": True, "three": False}


def kda_lead_layout(x: torch.Tensor, lead: tuple, layout: str, t0: int, t: int) -> torch.Tensor:
    """``x`` ``[R, T_total, *F]`` (rows row-major over ``lead``, ``prod(lead) = R``) stored in
    ``layout`` and cut to the tokens ``[t0, t0 + t)``, as the lead-dim view ``[*lead, t, *F]``
    the launchers take: ``"bthf"`` FLA's ``[B, T, H, *]`` with the time axis moved (``lead = (B,
    H)``; two stride groups), ``"bhtf"`` ``[B, H, T, *]`` (one group), ``"three"`` lead ``(a, b,
    h)`` stored ``[h, b, a, T, *]`` and permuted back (three groups that do not merge: the
    launchers copy)."""
    tt, feat = x.shape[1], tuple(x.shape[2:])
    rest = tuple(range(4, 4 + len(feat)))
    if layout == "bthf":
        b, h = lead
        view = x.reshape(b, h, tt, *feat).transpose(1, 2).contiguous().narrow(1, t0, t).movedim(1, 2)
    elif layout == "bhtf":
        view = x.reshape(*lead, tt, *feat).clone().narrow(len(lead), t0, t)
    elif layout == "three":
        perm = (2, 1, 0, 3, *rest)
        view = x.reshape(*lead, tt, *feat).permute(*perm).contiguous().permute(*perm).narrow(3, t0, t)
    else:
        raise ValueError(layout)
    lead_nd = len(lead)
    groups = kda_recurrent.row_groups(view.shape[:lead_nd], view.stride()[:lead_nd])
    assert (groups is not None) == KDA_LEAD_LAYOUTS[layout], (layout, view.stride())
    return view


def kda_lead_inputs(seed, layout, *, b=2, hq=2, group=2, t0=3, t=11, kd=12, vd=10, scalar_gate=False, h0=True,
                    broadcast=False, dtype=torch.float32):
    """Inputs of the KDA forward launchers with lead dims (:func:`kda_lead_layout`): q, k ``[B, Hq,
    t, K]``, v ``[B, Hv, t, V]``, g, beta (``Hv = group · Hq``; ``"three"``: lead ``(2, B, H)``), a
    time window ``t0 .. t0 + t`` of longer tensors; h0 ``[N, K, V]``. ``broadcast``: g and beta
    broadcast over the value heads (a stride-0 lead dim). Returns ``(views, flat)``: the five views
    and h0, and the same values as contiguous ``[rows, t, *]`` copies (for the reference)."""
    lead_q = (2, b, hq) if layout == "three" else (b, hq)
    nq = math.prod(lead_q)
    q, k, v, g, beta, s0 = kda_inputs(seed, nq, group, t0 + t + 2, kd, vd, scalar_gate=scalar_gate, h0=h0,
                                      dtype=dtype)
    lead_v = lead_q[:-1] + (hq * group,)
    views = [kda_lead_layout(x, lead, layout, t0, t) for x, lead in ((q, lead_q), (k, lead_q), (v, lead_v),
                                                                       (g, lead_v), (beta, lead_v))]
    if broadcast:  # one gate and beta per batch row, shared by its heads (stride 0)
        views[3:] = [x.narrow(len(lead_v) - 1, 0, 1).expand(x.shape) for x in views[3:]]
    flat = [x.reshape(math.prod(x.shape[:len(lead)]), *x.shape[len(lead):]).contiguous()
            for x, lead in zip(views, (lead_q, lead_q, lead_v, lead_v, lead_v))]
    return (*views, s0), (*flat, s0)


def check_kda_lead_forward(forward, layout, *, tol=None, scalar_gate=False, broadcast=False, seed=30, t=11, **kw):
    """``forward`` (a KDA forward launcher taking lead dims) on :func:`kda_lead_inputs` against the
    float64 reference on the flat copies; inputs read in place (``input_rows`` returns them
    themselves) unless the layout needs three groups. Returns ``(o, final state)``."""
    views, flat = kda_lead_inputs(seed, layout, scalar_gate=scalar_gate, broadcast=broadcast, t=t)
    for x, tail in zip(views[:5], (2, 2, 2, 1 if scalar_gate else 2, 1)):
        assert (kda_recurrent.input_rows(x, tail)[0] is x) == KDA_LEAD_LAYOUTS[layout]
    tol = KDA_TOL[torch.float32] if tol is None else tol
    with launch.poison_outputs():
        o, s = forward(*views[:5], scale=0.3, initial_state=views[5], output_final_state=True,
                       scalar_gate=scalar_gate, **kw)
    ref_o, ref_s = kda_reference_rows(*flat[:5], 0.3, flat[5], scalar_gate)
    assert o.shape == ref_o.shape and not o.isnan().any() and not s.isnan().any()
    assert rel_err(o, ref_o) < tol, f"{layout}: o relative error {rel_err(o, ref_o):.3g}"
    assert rel_err(s, ref_s) < tol, f"{layout}: final state relative error {rel_err(s, ref_s):.3g}"
    return o, s
