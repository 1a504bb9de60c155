"""Attention reference in float64: the ground truth every attention kernel is tested against."""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..codegen.attention import CAUSAL_MODES, MASK_KINDS, causal_offset

__all__ = ["reference", "CAUSAL_MODES", "MASK_KINDS", "causal_offset"]


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    causal: str = "none",
    mask: Optional[torch.Tensor] = None,
    mask_kind: str = "none",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention in float64.

    Args:
        q: ``[B, Hq, Nq, D]``.
        k: ``[B, Hkv, Nk, D]`` with ``Hq % Hkv == 0`` (GQA: query head h uses kv head
            ``h // (Hq // Hkv)``, as ``repeat_kv`` and ``repeat_interleave`` arrange it).
        v: ``[B, Hkv, Nk, Dv]``.
        scale: multiplies ``Q Kᵀ``.
        causal: ``"none"``, ``"top_left"`` (key j visible to query i iff j <= i) or
            ``"bottom_right"`` (iff j <= i + Nk - Nq).
        mask: broadcastable to ``[B, Hq, Nq, Nk]``; meaning set by ``mask_kind``.
        mask_kind: ``"none"``; ``"bool_keep"`` (True = visible, as SDPA's boolean mask and
            ``torch.where(m, s, -inf)``); ``"bool_drop"`` (True = hidden, as
            ``masked_fill(m, -inf)``); ``"additive"`` (added to the scaled scores).

    Returns:
        ``(out, lse)``: ``out`` ``[B, Hq, Nq, Dv]`` float64; ``lse`` ``[B, Hq, Nq]`` float64,
        the natural-log sum of exponentials of each row's visible scaled scores. A row with no
        visible key gives ``out = 0`` and ``lse = -inf`` (never NaN).

    Raises:
        ValueError: ``Hq`` is not a multiple of ``Hkv``, or an unknown ``mask_kind``.
    """
    q, k, v = q.double(), k.double(), v.double()
    hq, hkv = q.shape[1], k.shape[1]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hkv})")
    if hq != hkv:
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
    n_q, n_k = q.shape[-2], k.shape[-2]
    s = (q @ k.transpose(-2, -1)) * scale
    visible = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device)
    if causal != "none":
        off = causal_offset(causal, n_q, n_k)
        i = torch.arange(n_q, device=q.device)[:, None]
        j = torch.arange(n_k, device=q.device)[None, :]
        visible = j <= i + off
    visible = visible.expand(s.shape)
    if mask_kind == "additive":
        s = s + mask.double()
    elif mask_kind == "bool_keep":
        visible = visible & mask.bool()
    elif mask_kind == "bool_drop":
        visible = visible & ~mask.bool()
    elif mask_kind != "none":
        raise ValueError(f"unknown mask_kind {mask_kind!r}; expected one of {MASK_KINDS}")
    s = s.masked_fill(~visible, -math.inf)
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    l = p.sum(dim=-1, keepdim=True)
    out = (p @ v) / torch.where(l > 0, l, torch.ones_like(l))
    lse = (m + torch.log(l)).squeeze(-1)
    return out, lse
