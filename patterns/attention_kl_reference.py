"""Attention-KL reference in float64: the ground truth the attention-KL kernels are tested against.

Two attention distributions over the same keys, a teacher ``P1 = softmax(S1)`` and a student
``P2 = softmax(S2)``, and per query row the Kullback-Leibler divergence

    L_i = KL(P1_i ‖ P2_i) = Σ_j P1_ij (log P1_ij − log P2_ij)

(natural log; Kullback & Leibler, 1951; the same quantity ``F.kl_div(log P2, P1, reduction="none")
.sum(-1)`` computes, and the per-row term of attention distillation losses). The derivation of
the streaming form the kernels use is in ``DESIGN.md`` ("The math", attention-KL); this module
is deliberately the direct, materialised computation: both scaled score matrices, a masked
log-softmax of each, and the sum — independent of the kernels.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..codegen.attention import CAUSAL_MODES, MASK_KINDS, causal_offset

__all__ = ["reference", "CAUSAL_MODES", "MASK_KINDS", "causal_offset"]


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    hq, hkv = q.shape[1], k.shape[1]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hkv})")
    if hq != hkv:
        k = k.repeat_interleave(hq // hkv, dim=1)
    return (q @ k.transpose(-2, -1)) * scale


def _masked_log_softmax(s: torch.Tensor, visible: torch.Tensor):
    """(log P, P, lse) of the visible entries, NaN-free in value and gradient: hidden entries
    are replaced by the row max before ``exp`` (so nothing overflows) and then dropped."""
    m = s.masked_fill(~visible, -math.inf).amax(dim=-1, keepdim=True).detach()  # the max cancels
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    z = torch.where(visible, s, m.expand_as(s))
    e = torch.where(visible, torch.exp(z - m), torch.zeros_like(z))
    l = e.sum(dim=-1, keepdim=True)
    l_safe = torch.where(l > 0, l, torch.ones_like(l))
    log_p = z - m - torch.log(l_safe)
    p = e / l_safe
    lse = torch.where(l > 0, m + torch.log(l_safe), torch.full_like(l, -math.inf)).squeeze(-1)
    return log_p, p, lse


def reference(
    q1: torch.Tensor,
    k1: torch.Tensor,
    q2: torch.Tensor,
    k2: torch.Tensor,
    *,
    scale1: float,
    scale2: float,
    causal: str = "none",
    mask: Optional[torch.Tensor] = None,
    mask_kind: str = "none",
    dtype: torch.dtype = torch.float64,
) -> dict[str, torch.Tensor]:
    """Per-row KL divergence of the teacher's attention from the student's, in float64.

    Args:
        q1: teacher queries ``[B, H, Nq, D1]``.
        k1: teacher keys ``[B, Hkv1, Nk, D1]``, ``H % Hkv1 == 0`` (GQA: query head h uses kv
            head ``h // (H // Hkv1)``, as ``repeat_interleave`` arranges it).
        q2: student queries ``[B, H, Nq, D2]`` (D2 may differ from D1).
        k2: student keys ``[B, Hkv2, Nk, D2]``, ``H % Hkv2 == 0`` (GQA independent of side 1).
        scale1, scale2: multiply ``Q1 K1ᵀ`` and ``Q2 K2ᵀ``.
        causal: ``"none"``, ``"top_left"`` (key j visible to query i iff j <= i) or
            ``"bottom_right"`` (iff j <= i + Nk - Nq); the same for both sides.
        mask: broadcastable to ``[B, H, Nq, Nk]``, shared by both sides; ``mask_kind``:
            ``"bool_keep"`` (True = visible), ``"bool_drop"`` (True = hidden) or
            ``"additive"`` (added to both scaled score matrices; ``-inf`` hides an entry).
        dtype: computation dtype; float64 (the default) is the reference, float32 a faster
            stand-in for large GPU tests.

    Returns:
        A dict of ``[B, H, Nq]`` tensors in ``dtype``, natural log throughout:
        ``rows`` — ``L_i = Σ_j P1_ij (log P1_ij − log P2_ij)`` over the visible keys j;
        ``lse1``, ``lse2`` — log-sum-exp of each side's visible scaled scores;
        ``delta`` — ``E_{P1}[S1 − S2]`` (what the backward of the streaming kernels uses).
        A row with no visible key gives ``rows = 0``, ``delta = 0``, ``lse = -inf``, and zero
        gradients (never NaN): hidden entries contribute exactly 0.

    Raises:
        ValueError: a head count is not a multiple of its kv heads, shapes disagree, or an
            unknown ``causal``/``mask_kind``.
    """
    if causal not in CAUSAL_MODES:
        raise ValueError(f"causal must be one of {CAUSAL_MODES}, got {causal!r}")
    if mask_kind not in MASK_KINDS:
        raise ValueError(f"unknown mask_kind {mask_kind!r}; expected one of {MASK_KINDS}")
    if q1.shape[:3] != q2.shape[:3] or k1.shape[0] != k2.shape[0] or k1.shape[2] != k2.shape[2]:
        raise ValueError(
            f"both sides need the same B, H, Nq, Nk: q1 {tuple(q1.shape)}, k1 {tuple(k1.shape)}, "
            f"q2 {tuple(q2.shape)}, k2 {tuple(k2.shape)}"
        )
    q1, k1, q2, k2 = (t.to(dtype) for t in (q1, k1, q2, k2))
    s1 = _scores(q1, k1, scale1)
    s2 = _scores(q2, k2, scale2)
    n_q, n_k = s1.shape[-2], s1.shape[-1]
    visible = torch.ones(n_q, n_k, dtype=torch.bool, device=s1.device)
    if causal != "none":
        off = causal_offset(causal, n_q, n_k)
        i = torch.arange(n_q, device=s1.device)[:, None]
        j = torch.arange(n_k, device=s1.device)[None, :]
        visible = j <= i + off
    visible = visible.expand(s1.shape)
    if mask_kind == "additive":
        bias = mask.to(dtype)
        s1 = s1 + bias
        s2 = s2 + bias
        visible = visible & ~torch.isneginf(bias).expand(s1.shape)
    elif mask_kind == "bool_keep":
        visible = visible & mask.bool()
    elif mask_kind == "bool_drop":
        visible = visible & ~mask.bool()
    log_p1, p1, lse1 = _masked_log_softmax(s1, visible)
    log_p2, _, lse2 = _masked_log_softmax(s2, visible)
    zero = torch.zeros((), dtype=dtype, device=s1.device)
    rows = torch.where(visible, p1 * (log_p1 - log_p2), zero).sum(-1)
    # E_P1[S1 - S2]; hidden entries of s (possibly -inf) are never touched by the product
    diff = torch.where(visible, s1, zero) - torch.where(visible, s2, zero)
    delta = torch.where(visible, p1 * diff, zero).sum(-1)
    return {"rows": rows, "lse1": lse1, "lse2": lse2, "delta": delta}
