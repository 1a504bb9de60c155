"""Attention reference in float64: the ground truth every attention kernel is tested against."""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from ..codegen import predicate as _predicate
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
    mask_fill: float = -math.inf,
    causal_fill: float = -math.inf,
    causal_fill_mode: str = "replace",
    mask_pred=None,
    pred_consts: Sequence[int] = (),
    pred_fill: float = -math.inf,
    pred_fill_mode: str = "replace",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention in float64, written directly on the materialised scores.

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
            ``torch.where(m, s, fill)``); ``"bool_drop"`` (True = hidden, as
            ``masked_fill(m, fill)``); ``"additive"`` (added to the scaled scores).
        mask_fill: the score of a boolean mask's hidden entry (it replaces the score: no
            gradient flows to q, k there); ``-inf`` hides it. Ignored by other mask kinds.
        causal_fill: the score of an entry above the causal diagonal (``causal_fill_mode=
            "replace"``) or what is added to it (``"add"``, an additive causal mask whose
            gradient flows to the score as for any additive mask); ``-inf`` hides it.
            Ignored without causal masking.
        causal_fill_mode: ``"replace"`` or ``"add"``.
        mask_pred: an index predicate over query ``i`` and key ``j`` (a
            ``codegen/predicate.py`` tuple or its text; ``None`` or ``""``: none): a nested
            ``("atom", a, b, k)`` = ``a*i + b*j + pred_consts[k] >= 0``, ``("and", ...)``,
            ``("or", ...)``, ``("true",)``, ``("false",)``. Query i keeps key j iff it holds.
        pred_consts: the predicate's integer constants.
        pred_fill: the score of an entry the predicate drops (``pred_fill_mode="replace"``, no
            gradient there) or what is added to it (``"add"``); ``-inf`` hides it.
        pred_fill_mode: ``"replace"`` or ``"add"``.

    Scores: ``s = scale · q kᵀ`` (``+ mask`` for ``"additive"``), then the boolean mask's fill,
    then the causal fill, then the predicate's fill, all in float64; the softmax runs over every
    key of the row.

    Returns:
        ``(out, lse)``: ``out`` ``[B, Hq, Nq, Dv]`` float64; ``lse`` ``[B, Hq, Nq]`` float64,
        the natural-log sum of the exponentials of each row's scores. A row whose scores are all
        ``-inf`` gives ``out = 0`` and ``lse = -inf`` (never NaN; eager softmax gives NaN); a row
        of finite fills gets their softmax (a uniform average for one constant fill).

    Raises:
        ValueError: ``Hq`` is not a multiple of ``Hkv``, an unknown ``mask_kind`` or
            ``causal_fill_mode``, or a NaN or ``+inf`` fill.
    """
    for name, value in (("mask_fill", mask_fill), ("causal_fill", causal_fill), ("pred_fill", pred_fill)):
        if math.isnan(value) or value == math.inf:
            raise ValueError(f"{name} must be finite or -inf, got {value!r}")
    for name, mode in (("causal_fill_mode", causal_fill_mode), ("pred_fill_mode", pred_fill_mode)):
        if mode not in ("replace", "add"):
            raise ValueError(f"{name} must be 'replace' or 'add', got {mode!r}")
    q, k, v = q.double(), k.double(), v.double()
    hq, hkv = q.shape[1], k.shape[1]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hkv})")
    if hq != hkv:
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
    n_q, n_k = q.shape[-2], k.shape[-2]
    s = (q @ k.transpose(-2, -1)) * scale
    if mask_kind == "additive":
        s = s + mask.double()
    elif mask_kind in ("bool_keep", "bool_drop"):
        hidden = ~mask.bool() if mask_kind == "bool_keep" else mask.bool()
        s = torch.where(hidden, torch.full_like(s, mask_fill), s)
    elif mask_kind != "none":
        raise ValueError(f"unknown mask_kind {mask_kind!r}; expected one of {MASK_KINDS}")
    if causal != "none":
        off = causal_offset(causal, n_q, n_k)
        i = torch.arange(n_q, device=q.device)[:, None]
        j = torch.arange(n_k, device=q.device)[None, :]
        above = j > i + off
        filled = torch.full_like(s, causal_fill) if causal_fill_mode == "replace" else s + causal_fill
        s = torch.where(above, filled, s)
    if mask_pred is not None and not (isinstance(mask_pred, str) and not mask_pred.strip()):
        pred = _predicate.parse(mask_pred) if isinstance(mask_pred, str) else _predicate.validate(mask_pred)
        i = torch.arange(n_q, device=q.device)[:, None]
        j = torch.arange(n_k, device=q.device)[None, :]
        dropped = ~_keep(pred, i, j, [int(c) for c in pred_consts]).expand(n_q, n_k)
        filled = torch.full_like(s, pred_fill) if pred_fill_mode == "replace" else s + pred_fill
        s = torch.where(dropped, filled, s)
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    l = p.sum(dim=-1, keepdim=True)
    out = (p @ v) / torch.where(l > 0, l, torch.ones_like(l))
    lse = (m + torch.log(l)).squeeze(-1)
    return out, lse


def _keep(pred: tuple, i: torch.Tensor, j: torch.Tensor, consts: list) -> torch.Tensor:
    """The predicate on index grids, written out here (independent of the kernels' rendering)."""
    op = pred[0]
    if op == "atom":
        _, a, b, k = pred
        return a * i + b * j + consts[k] >= 0
    if op in ("true", "false"):
        return torch.full((i.shape[0], j.shape[1]), op == "true", device=i.device)
    parts = [_keep(p, i, j, consts) for p in pred[1:]]
    out = parts[0]
    for p in parts[1:]:
        out = (out & p) if op == "and" else (out | p)
    return out
