"""Float64 references of Kimi Delta Attention (KDA): the token recurrence and its chunked (WY) form.

KDA (Kimi Linear, Moonshot AI 2025; the gated delta rule of Yang et al., "Gated Delta Networks",
ICLR 2025, with a per-key-channel decay) keeps a ``[K, V]`` state per value head and updates it
every token ``t``:

    S ← diag(exp g_t) S                      (per-key-channel decay; g_t ≤ 0 in practice)
    v̂_t = Sᵀ k_t                              (what the decayed state predicts for k_t)
    S ← S + β_t k_t (v_t − v̂_t)ᵀ              (delta-rule correction, β_t ∈ (0, 1))
    o_t = Sᵀ (scale · q_t)                    (read-out)

Layout (FLA's): q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``; g ``[B, T, HV, K]`` (log-space
decay); beta ``[B, T, HV]``; ``HV % H == 0`` (grouped value heads: value head ``h`` reads query/key
head ``h // (HV // H)``); the state ``[B, HV, K, V]``; ``scale`` defaults to ``K ** -0.5``.

The chunked form (chunk of C tokens, ``G`` the inclusive cumulative sum of g inside the chunk,
``S0`` the state before it; derivation in ``docs/math.md``, "KDA"): with
``A_kk[r, s] = Σ_d k_r,d k_s,d e^{G_r,d − G_s,d}`` (s < r) and ``A_qk[r, s] = Σ_d q_r,d k_s,d
e^{G_r,d − G_s,d}`` (s ≤ r),

    T = (I + diag(β) A_kk)⁻¹ diag(β),   U = T V,   W = T (K ∘ e^G),   Δ = U − W S0
    O = (Q ∘ e^G) S0 + A_qk Δ,          S_C = diag(e^{G_C}) S0 + (K ∘ e^{G_C − G})ᵀ Δ

``e^{G_r − G_s}`` is computed pairwise (≤ 1 for s ≤ r when g ≤ 0); the factorised
``e^{G_r} · e^{−G_s}`` overflows for long chunks. Both functions compute in float64 whatever the
input dtype and return float64; they are the oracles of the KDA kernels and pattern.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["recurrent", "chunked", "step"]


def _check(q, k, v, g, beta, initial_state):
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must be [B, T, H, K] of one shape, got {tuple(q.shape)} and {tuple(k.shape)}")
    b, t, h, kd = q.shape
    if v.dim() != 4 or v.shape[:2] != (b, t) or v.shape[2] % h:
        raise ValueError(f"v must be [B, T, HV, V] with HV a multiple of H={h}, got {tuple(v.shape)}")
    hv = v.shape[2]
    if g.shape != (b, t, hv, kd):
        raise ValueError(f"g must be [B, T, HV, K] = {(b, t, hv, kd)}, got {tuple(g.shape)}")
    if beta.shape != (b, t, hv):
        raise ValueError(f"beta must be [B, T, HV] = {(b, t, hv)}, got {tuple(beta.shape)}")
    if initial_state is not None and initial_state.shape != (b, hv, kd, v.shape[-1]):
        raise ValueError(f"initial_state must be [B, HV, K, V] = {(b, hv, kd, v.shape[-1])}, "
                         f"got {tuple(initial_state.shape)}")
    return hv // h


def _prepare(q, k, v, g, beta, scale, initial_state):
    """Float64 copies with q, k repeated to the value heads and q scaled; the initial state."""
    group = _check(q, k, v, g, beta, initial_state)
    kd = q.shape[-1]
    scale = kd ** -0.5 if scale is None else float(scale)
    f = torch.float64
    q = q.to(f).repeat_interleave(group, dim=2) * scale
    k = k.to(f).repeat_interleave(group, dim=2)
    b, _, hv, _ = v.shape
    s = torch.zeros(b, hv, kd, v.shape[-1], dtype=f, device=q.device)
    if initial_state is not None:
        s = s + initial_state.to(f)
    return q, k, v.to(f), g.to(f), beta.to(f), s


def step(s: torch.Tensor, q_t, k_t, v_t, g_t, beta_t) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the recurrence on ``[B, HV, K, V]`` state ``s`` (q_t already scaled, all
    inputs ``[B, HV, *]``): returns ``(o_t [B, HV, V], new state)``."""
    s = s * g_t.exp()[..., None]
    v_hat = (k_t[..., None] * s).sum(-2)
    s = s + (beta_t[..., None] * k_t)[..., :, None] * (v_t - v_hat)[..., None, :]
    return (q_t[..., None] * s).sum(-2), s


def recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """KDA token by token, in float64 (see the module docstring for shapes).

    Returns:
        ``(o [B, T, HV, V], final state [B, HV, K, V] or None)``, float64.

    Raises:
        ValueError: inconsistent shapes.
    """
    q, k, v, g, beta, s = _prepare(q, k, v, g, beta, scale, initial_state)
    o = torch.empty_like(v)
    for t in range(q.shape[1]):
        o[:, t], s = step(s, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t])
    return o, (s if output_final_state else None)


def chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False, chunk: int = 64,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """KDA in chunks of ``chunk`` tokens (the WY form of the module docstring), in float64; the
    last chunk may be shorter (T need not be a multiple of ``chunk``).

    Returns:
        ``(o [B, T, HV, V], final state [B, HV, K, V] or None)``, float64; equal to
        :func:`recurrent` up to float64 rounding.

    Raises:
        ValueError: inconsistent shapes, or ``chunk < 1``.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    q, k, v, g, beta, s = _prepare(q, k, v, g, beta, scale, initial_state)
    # [B, HV, T, *]: heads before time, so a chunk is a contiguous slice of dim 2
    q, k, v, g = (x.transpose(1, 2) for x in (q, k, v, g))
    beta = beta.transpose(1, 2)
    t_len = q.shape[2]
    o = torch.empty_like(v)
    for c0 in range(0, t_len, chunk):
        sl = slice(c0, min(c0 + chunk, t_len))
        qc, kc, vc, bc = q[:, :, sl], k[:, :, sl], v[:, :, sl], beta[:, :, sl]
        cg = g[:, :, sl].cumsum(2)                                 # G, inclusive  [B, HV, C, K]
        n = qc.shape[2]
        # pairwise decays e^{G_r - G_s} [B, HV, C(r), C(s), K] for s <= r; above the diagonal the
        # exponent is set to -inf before exp (e^{G_r - G_s} > 1 there and overflows: inf * 0 = NaN)
        incl = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        diff = (cg[:, :, :, None, :] - cg[:, :, None, :, :]).masked_fill(~incl[:, :, None], float("-inf"))
        decay = diff.exp()
        a_kk = torch.einsum("bhrd,bhsd,bhrsd->bhrs", kc, kc, decay).tril(-1)   # s < r
        a_qk = torch.einsum("bhrd,bhsd,bhrsd->bhrs", qc, kc, decay)            # s <= r (0 above)
        lower = torch.eye(n, dtype=q.dtype, device=q.device) + bc[..., :, None] * a_kk
        t_mat = torch.linalg.solve_triangular(lower, torch.diag_embed(bc), upper=False, unitriangular=True)
        u = t_mat @ vc
        w = t_mat @ (kc * cg.exp())
        delta = u - w @ s
        o[:, :, sl] = (qc * cg.exp()) @ s + a_qk @ delta
        last = cg[:, :, -1]                                        # G_C  [B, HV, K]
        s = last.exp()[..., None] * s + (kc * (last[:, :, None, :] - cg).exp()).transpose(-1, -2) @ delta
    return o.transpose(1, 2), (s if output_final_state else None)
