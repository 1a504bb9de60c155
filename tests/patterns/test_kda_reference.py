"""The float64 KDA references (patterns/kda_reference.py): the chunked (WY) form equals the token
recurrence, the recurrence equals the update written out by hand on tiny cases, and bad shapes
are rejected."""

from __future__ import annotations

import pytest
import torch

from fuser.patterns.kda_reference import chunked, recurrent, step


def _inputs(seed, b, t, h, hv, kd, vd, *, state=False, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, h, kd, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(b, t, h, kd, generator=gen), dim=-1)  # l2-normalised keys
    v = torch.randn(b, t, hv, vd, generator=gen)
    g = -torch.nn.functional.softplus(torch.randn(b, t, hv, kd, generator=gen))  # log decay <= 0
    beta = torch.rand(b, t, hv, generator=gen)
    h0 = torch.randn(b, hv, kd, vd, generator=gen) if state else None
    return tuple(x.to(dtype) for x in (q, k, v, g, beta)), (None if h0 is None else h0.to(dtype))


@pytest.mark.parametrize("b,t,h,hv,kd,vd,chunk,state", [
    (1, 16, 1, 1, 4, 4, 4, False),
    (2, 37, 2, 2, 8, 5, 16, True),     # T not a multiple of the chunk
    (1, 23, 1, 3, 6, 7, 64, True),     # one partial chunk; grouped value heads (HV = 3 H)
    (2, 50, 2, 4, 5, 3, 7, False),
    (1, 9, 1, 1, 3, 2, 1, True),       # chunk of one token
])
def test_chunked_equals_recurrent(b, t, h, hv, kd, vd, chunk, state):
    (q, k, v, g, beta), h0 = _inputs(b * 100 + t, b, t, h, hv, kd, vd, state=state)
    o_r, s_r = recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_c, s_c = chunked(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk=chunk)
    assert o_r.dtype == torch.float64 and o_r.shape == (b, t, hv, vd) and s_r.shape == (b, hv, kd, vd)
    torch.testing.assert_close(o_c, o_r, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s_c, s_r, rtol=1e-10, atol=1e-10)


def test_strong_decay_long_chunk_stays_finite():
    """Gates near -30 per token: the factorised e^{G_r} e^{-G_s} would overflow float64 within a
    chunk of 64 (e^{30*64}); the pairwise form does not."""
    (q, k, v, g, beta), _ = _inputs(3, 1, 64, 1, 1, 4, 4)
    g = g - 30.0
    o_c, _ = chunked(q, k, v, g, beta, chunk=64)
    o_r, _ = recurrent(q, k, v, g, beta)
    assert torch.isfinite(o_c).all()
    torch.testing.assert_close(o_c, o_r, rtol=1e-9, atol=1e-12)


def test_recurrence_by_hand():
    """K = V = 1, one head: s <- e^g s; s <- s + beta k (v - k s); o = scale q s."""
    q = torch.tensor([2.0, -1.0, 0.5]).view(1, 3, 1, 1)
    k = torch.tensor([1.0, 0.5, -2.0]).view(1, 3, 1, 1)
    v = torch.tensor([3.0, 1.0, 2.0]).view(1, 3, 1, 1)
    g = torch.tensor([-0.1, -0.2, 0.0]).view(1, 3, 1, 1)
    beta = torch.tensor([0.5, 1.0, 0.25]).view(1, 3, 1)
    s, want = 0.7, []
    for t in range(3):
        s = s * float(g.flatten()[t].double().exp())
        kt, vt, bt = (float(x.flatten()[t]) for x in (k, v, beta))
        s = s + bt * kt * (vt - kt * s)
        want.append(0.5 * float(q.flatten()[t]) * s)  # scale given: 0.5
    o, s_final = recurrent(q, k, v, g, beta, scale=0.5, initial_state=torch.full((1, 1, 1, 1), 0.7),
                           output_final_state=True)
    torch.testing.assert_close(o.flatten(), torch.tensor(want, dtype=torch.float64))
    assert abs(float(s_final) - s) < 1e-12


def test_no_update_keeps_the_state():
    """beta = 0 and g = 0: the state never changes, o_t = scale q_t^T h0."""
    (q, k, v, g, beta), h0 = _inputs(5, 2, 6, 1, 2, 4, 3, state=True)
    o, s = recurrent(q, k, v, torch.zeros_like(g), torch.zeros_like(beta), initial_state=h0, output_final_state=True)
    torch.testing.assert_close(s, h0.double())
    want = torch.einsum("bthk,bhkv->bthv", q.double().repeat_interleave(2, dim=2) * 4 ** -0.5, h0.double())
    torch.testing.assert_close(o, want)
    assert recurrent(q, k, v, g, beta)[1] is None  # no final state unless asked


def test_step_is_the_recurrence():
    (q, k, v, g, beta), h0 = _inputs(7, 1, 1, 2, 2, 3, 4, state=True)
    o, s = recurrent(q, k, v, g, beta, scale=1.0, initial_state=h0, output_final_state=True)
    f = torch.float64
    o1, s1 = step(h0.to(f), q[:, 0].to(f), k[:, 0].to(f), v[:, 0].to(f), g[:, 0].to(f), beta[:, 0].to(f))
    torch.testing.assert_close(o[:, 0], o1)
    torch.testing.assert_close(s, s1)


@pytest.mark.parametrize("bad", ["k", "v_heads", "g", "beta", "state", "chunk"])
def test_bad_shapes(bad):
    (q, k, v, g, beta), h0 = _inputs(1, 1, 4, 2, 2, 3, 3, state=True)
    kw = {}
    if bad == "k":
        k = k[..., :2]
    elif bad == "v_heads":
        v = v.repeat(1, 1, 2, 1)[:, :, :3]  # HV = 3 is not a multiple of H = 2
    elif bad == "g":
        g = g[..., :1]
    elif bad == "beta":
        beta = beta[..., None]
    elif bad == "state":
        h0 = h0[..., :1]
    else:
        kw["chunk"] = 0
    with pytest.raises(ValueError):
        chunked(q, k, v, g, beta, initial_state=h0, **kw)
