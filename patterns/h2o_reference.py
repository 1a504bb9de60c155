"""H2O column-sum reference in float64: the ground truth the H2O kernels are tested against.

H2O (Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
Models", NeurIPS 2023) ranks the keys of a KV cache by the accumulated attention they receive: the
column sums of the attention probabilities. Keys with the largest sums ("heavy hitters") are kept
when the cache is evicted.
"""

from __future__ import annotations

import math

from typing import Optional

import torch

from .attention_reference import CAUSAL_MODES, MASK_KINDS, reference as attention_reference

__all__ = ["reference", "probabilities", "CAUSAL_MODES", "MASK_KINDS"]


def probabilities(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float,
    causal: str = "none",
    mask: Optional[torch.Tensor] = None,
    mask_kind: str = "none",
    causal_fill: float = -math.inf,
    causal_fill_mode: str = "replace",
) -> torch.Tensor:
    """The attention probabilities ``P = softmax(scale · Q Kᵀ (+ mask), dim=-1)``, materialised
    in float64 as ``[B, Hq, Nq, Nk]``; a row with no visible key is all 0 (eager gives NaN).

    The softmax is :func:`fuser.patterns.attention_reference.reference` itself (the same masks,
    causal alignments and GQA head mapping), run with the identity as ``v``: ``out = P · I = P``.
    Arguments as in :func:`reference`.
    """
    b, hkv, n_k = k.shape[0], k.shape[1], k.shape[2]
    eye = torch.eye(n_k, dtype=torch.float64, device=k.device).expand(b, hkv, n_k, n_k)
    p, _ = attention_reference(q, k, eye, scale=scale, causal=causal, mask=mask, mask_kind=mask_kind,
                               causal_fill=causal_fill, causal_fill_mode=causal_fill_mode)
    return p


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: Optional[torch.Tensor] = None,
    *,
    scale: float,
    causal: str = "none",
    mask: Optional[torch.Tensor] = None,
    mask_kind: str = "none",
    causal_fill: float = -math.inf,
    causal_fill_mode: str = "replace",
) -> tuple[Optional[torch.Tensor], torch.Tensor]:
    """H2O column sums (and attention output) in float64, on the materialised probabilities.

    Definition (H2O, Zhang et al., NeurIPS 2023): with ``P = softmax(scale · Q Kᵀ (+ mask),
    dim=-1)`` of shape ``[B, Hq, Nq, Nk]``, ``score[b, h, j] = Σ_i P[b, h, i, j]``, the total
    attention key j receives from the queries of head h; and ``out = P V``.

    Args:
        q: ``[B, Hq, Nq, D]``, any floating dtype (computed in float64).
        k: ``[B, Hkv, Nk, D]`` with ``Hq % Hkv == 0`` (GQA: query head h uses kv head
            ``h // (Hq // Hkv)``); scores are per query head.
        v: ``[B, Hkv, Nk, Dv]`` or ``None`` (then no ``out``).
        scale: multiplies ``Q Kᵀ``.
        causal: ``"none"``, ``"top_left"`` (key j visible to query i iff ``j <= i``) or
            ``"bottom_right"`` (iff ``j <= i + Nk − Nq``); entries above the diagonal hidden.
        mask: broadcastable to ``[B, Hq, Nq, Nk]``; ``mask_kind`` ``"bool_keep"`` (True =
            visible), ``"bool_drop"`` (True = hidden), ``"additive"`` (added to the scaled
            scores), ``"none"`` (no mask). Hidden entries are ``-inf``, as in
            :func:`fuser.patterns.attention_reference.reference`.
        causal_fill, causal_fill_mode: with causal masking, the entries above the diagonal score
            ``causal_fill`` (``"replace"``) or ``s + causal_fill`` (``"add"``) instead of
            ``-inf``, as in the attention reference.

    Returns:
        ``(out, score)``: ``out`` ``[B, Hq, Nq, Dv]`` float64 (``None`` when ``v`` is ``None``;
        0 on rows with no visible key); ``score`` ``[B, Hq, Nk]`` float64. A row with no
        visible key contributes 0 to every column; a key no query sees scores 0.

    Raises:
        ValueError: ``Hq`` not a multiple of ``Hkv``, or an unknown ``mask_kind``.
    """
    p = probabilities(q, k, scale=scale, causal=causal, mask=mask, mask_kind=mask_kind, causal_fill=causal_fill,
                      causal_fill_mode=causal_fill_mode)
    score = p.sum(dim=-2)
    out = None
    if v is not None:
        vv = v.double()
        if vv.shape[1] != p.shape[1]:
            vv = vv.repeat_interleave(p.shape[1] // vv.shape[1], dim=1)
        out = p @ vv
    return out, score
