"""Attention-KL reference in float64: the ground truth the attention-KL kernels are tested against.

Two attention distributions over the same keys, a teacher ``P1 = softmax(S1)`` and a student
``P2 = softmax(S2)``, and per query row the Kullback-Leibler divergence

    L_i = KL(P1_i ‖ P2_i) = Σ_j P1_ij (log P1_ij − log P2_ij)

(natural log; Kullback & Leibler, 1951; the same quantity ``F.kl_div(log P2, P1, reduction="none")
.sum(-1)`` computes, and the per-row term of attention distillation losses). The derivation of
the streaming form the kernels use is in ``docs/math.md`` (attention-KL); this module
is deliberately the direct, materialised computation: both scaled score matrices, a masked
log-softmax of each, and the sum — independent of the kernels.

Hidden entries ("fills"): a boolean mask's hidden entry, or an entry above the causal diagonal,
gets a score per side — ``-inf`` (hidden: excluded, today's default) or a finite fill, which
``torch.where`` puts in place of the score (``"replace"``: no gradient reaches the score there)
or adds to it (causal ``"add"``: an additive causal mask, the gradient flows). Eager PyTorch
gives exactly this for ``s.masked_fill(m, fill)``, ``torch.where(m, s, fill)`` or ``s + bias``.

``zero_hidden``: the KL terms of the hidden entries (those the boolean mask or the causal
structure hides, whatever their fill) are zeroed after the KL, as a distillation loss written
``kl_div(...).masked_fill(m, 0).sum(-1)`` does; the hidden entries still count in both softmaxes.
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
    """(log P, P, lse, max, log l) of the visible entries, NaN-free in value and gradient:
    hidden entries are replaced by the row max before ``exp`` (so nothing overflows) and then
    dropped. ``max`` and ``log l`` (``lse = max + log l``, kept apart so that a huge finite max
    does not swallow ``log l``) are ``-inf`` for a row with no visible entry."""
    m = s.masked_fill(~visible, -math.inf).amax(dim=-1, keepdim=True).detach()  # the max cancels
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    z = torch.where(visible, s, m.expand_as(s))
    e = torch.where(visible, torch.exp(z - m), torch.zeros_like(z))
    l = e.sum(dim=-1, keepdim=True)
    l_safe = torch.where(l > 0, l, torch.ones_like(l))
    log_p = z - m - torch.log(l_safe)
    p = e / l_safe
    empty = torch.full_like(l, -math.inf)
    lse = torch.where(l > 0, m + torch.log(l_safe), empty).squeeze(-1)
    row_max = torch.where(l > 0, m, empty).squeeze(-1)
    log_l = torch.where(l > 0, torch.log(l_safe), empty).squeeze(-1)
    return log_p, p, lse, row_max, log_l


def _filled(s, hidden, above, mask_fill: float, causal_fill: float, causal_fill_mode: str):
    """One side's scores with the fills applied: first the boolean mask's replace, then the
    causal fill (replace or add); ``-inf`` fills hide."""
    if hidden is not None:
        s = torch.where(hidden, torch.full_like(s, mask_fill), s)
    if above is not None:
        if causal_fill_mode == "replace":
            s = torch.where(above, torch.full_like(s, causal_fill), s)
        else:
            s = torch.where(above, s + causal_fill, s)
    return s


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
    mask_fill1: float = -math.inf,
    mask_fill2: float = -math.inf,
    causal_fill1: float = -math.inf,
    causal_fill2: float = -math.inf,
    causal_fill_mode: str = "replace",
    zero_hidden: bool = False,
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
        mask_fill1, mask_fill2: the score (natural units, after the scale) a boolean mask's
            hidden entry takes on side 1 / side 2 ("replace": no gradient to its score);
            ``-inf`` hides it.
        causal_fill1, causal_fill2, causal_fill_mode: an entry above the causal diagonal takes
            the fill (``"replace"``) or gets it added (``"add"``: the gradient flows), per side;
            ``-inf`` hides it. Applied after the boolean mask.
        zero_hidden: zero the KL terms of the entries the boolean mask or the causal structure
            hides (an additive mask hides nothing here), after the KL:
            ``L_i = Σ_{j visible} P1_ij (log P1_ij − log P2_ij)``.

    Returns:
        A dict of ``[B, H, Nq]`` tensors in ``dtype``, natural log throughout:
        ``rows`` — ``L_i = Σ_j P1_ij (log P1_ij − log P2_ij)`` over the keys j with P1 > 0
        (every key whose score is not ``-inf``; with finite fills, hidden keys carry mass);
        ``lse1``, ``lse2`` — log-sum-exp of each side's scores; ``max1``, ``max2`` and
        ``logl1``, ``logl2`` — its two parts, the row max and ``log Σ_j exp(s − max)``;
        ``delta`` — ``E_{P1}[S1 − S2]``; ``mean`` — its offset-free form
        ``E_{P1}[(S1 − max1) − (S2 − max2)]`` (what the kernels' two-part statistics hold).
        A row with no visible key on side 1 gives ``rows = 0``, ``delta = mean = 0``, ``-inf``
        for the lse and its parts, and zero gradients (never NaN): ``-inf`` entries contribute
        exactly 0. A key visible on side 1 but ``-inf`` on side 2 gives ``rows = +inf``
        (unless ``zero_hidden`` zeroes its term).
        Also ``h1`` — the teacher's hidden mass ``Σ_{j hidden} P1_ij`` (hidden: by the boolean mask
        or the causal structure), ``w1`` — its visible mass ``Σ_{j visible} P1_ij`` (``1 − h1``; both
        0 for a row with no key on side 1), and, with ``zero_hidden``, ``mean_zh`` — the
        kernels' offset-free zero_hidden DELTA in natural units,
        ``Σ_{j visible} P1 ((S1 − max1) − (S2 − max2)) − h1 (log(l2 / l1) + 1)`` (0 where ``w1 = 0``).

    Raises:
        ValueError: a head count is not a multiple of its kv heads, shapes disagree, or an
            unknown ``causal``/``mask_kind``.
    """
    if causal not in CAUSAL_MODES:
        raise ValueError(f"causal must be one of {CAUSAL_MODES}, got {causal!r}")
    if mask_kind not in MASK_KINDS:
        raise ValueError(f"unknown mask_kind {mask_kind!r}; expected one of {MASK_KINDS}")
    if causal_fill_mode not in ("replace", "add"):
        raise ValueError(f"causal_fill_mode must be 'replace' or 'add', got {causal_fill_mode!r}")
    if q1.shape[:3] != q2.shape[:3] or k1.shape[0] != k2.shape[0] or k1.shape[2] != k2.shape[2]:
        raise ValueError(
            f"both sides need the same B, H, Nq, Nk: q1 {tuple(q1.shape)}, k1 {tuple(k1.shape)}, "
            f"q2 {tuple(q2.shape)}, k2 {tuple(k2.shape)}"
        )
    q1, k1, q2, k2 = (t.to(dtype) for t in (q1, k1, q2, k2))
    s1 = _scores(q1, k1, scale1)
    s2 = _scores(q2, k2, scale2)
    n_q, n_k = s1.shape[-2], s1.shape[-1]
    above = None
    if causal != "none":
        off = causal_offset(causal, n_q, n_k)
        i = torch.arange(n_q, device=s1.device)[:, None]
        j = torch.arange(n_k, device=s1.device)[None, :]
        above = (j > i + off).expand(s1.shape)
    hidden = None
    if mask_kind == "additive":
        bias = mask.to(dtype)
        s1 = s1 + bias
        s2 = s2 + bias
    elif mask_kind == "bool_keep":
        hidden = ~mask.bool().expand(s1.shape)
    elif mask_kind == "bool_drop":
        hidden = mask.bool().expand(s1.shape)
    s1 = _filled(s1, hidden, above, mask_fill1, causal_fill1, causal_fill_mode)
    s2 = _filled(s2, hidden, above, mask_fill2, causal_fill2, causal_fill_mode)
    # an entry is visible where its score is not -inf (hidden entries and -inf fills are)
    vis1, vis2 = ~torch.isneginf(s1), ~torch.isneginf(s2)
    log_p1, p1, lse1, max1, logl1 = _masked_log_softmax(s1, vis1)
    log_p2, _, lse2, max2, logl2 = _masked_log_softmax(s2, vis2)
    # a key with P1 > 0 that side 2 hides has log P2 = -inf (L = +inf); elsewhere log_p2 stays finite
    log_p2 = torch.where(vis2 | ~vis1, log_p2, -math.inf)
    zero = torch.zeros((), dtype=dtype, device=s1.device)
    # the entries the boolean mask or the causal structure hides (whatever their fill)
    structural = torch.zeros(s1.shape, dtype=torch.bool, device=s1.device)
    for part in (hidden, above):
        if part is not None:
            structural = structural | part
    # the terms kept in L: every key with P1 > 0, or with zero_hidden only those not hidden
    # (zeroed after the KL, as masked_fill(m, 0) on the terms does; the double where keeps the
    # gradient NaN-free where a zeroed term would be infinite)
    keep = vis1 & ~structural if zero_hidden else vis1
    terms = p1 * (log_p1 - torch.where(keep, log_p2, zero))
    rows = torch.where(keep, terms, zero).sum(-1)
    # E_P1[S1 - S2]; entries with P1 = 0 (s1 = -inf) are never touched by the product
    diff = torch.where(vis1, s1, zero) - torch.where(vis1, s2, zero)
    delta = torch.where(vis1, p1 * diff, zero).sum(-1)
    # the same offset-free: (S1 - max1) - (S2 - max2) (exact where the maxima are huge)
    fin = lambda m: torch.where(torch.isfinite(m), m, zero)[..., None]  # noqa: E731
    diff0 = torch.where(vis1, s1 - fin(max1), zero) - torch.where(vis1, s2 - fin(max2), zero)
    mean = torch.where(vis1, p1 * diff0, zero).sum(-1)
    # the teacher's mass on hidden and on visible entries
    h1 = torch.where(vis1 & structural, p1, zero).sum(-1)
    w1 = torch.where(vis1 & ~structural, p1, zero).sum(-1)
    out = {"rows": rows, "lse1": lse1, "lse2": lse2, "delta": delta, "max1": max1, "max2": max2,
           "logl1": logl1, "logl2": logl2, "mean": mean, "h1": h1, "w1": w1}
    if zero_hidden:
        mean_v = torch.where(keep, p1 * diff0, zero).sum(-1)
        ratio = torch.where(w1 > 0, logl2 - logl1, zero)  # log(l2 / l1), finite where w1 > 0
        out["mean_zh"] = torch.where(w1 > 0, mean_v - h1 * (ratio + 1), zero)
    return out
