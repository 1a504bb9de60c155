"""The fused H2O op: ``torch.ops.fuser.h2o``.

A ``torch.library.custom_op`` with a fake (meta) implementation, so Dynamo, AOTAutograd and
Inductor treat it as an opaque kernel with known output shapes; it neither mutates nor aliases
its inputs. It has no autograd formula: the pattern declines regions whose outputs need
gradients (H2O scores keys during inference). The kernels are in ``codegen/h2o.py``.

``torch.ops.fuser.h2o(q, k, v, mask, scale, causal, mask_kind, need_out) -> (out, score)``
    q ``[B, Hq, Nq, D]``, k ``[B, Hkv, Nk, D]``, v ``[B, Hkv, Nk, Dv]`` or None (any strides;
    GQA when ``Hkv < Hq``); ``mask`` broadcastable to ``[B, Hq, Nq, Nk]`` or None; ``causal`` in
    ``{"none", "top_left", "bottom_right"}``; ``mask_kind`` in ``{"none", "bool_keep",
    "bool_drop", "additive"}``. Returns ``out = softmax(scale·q kᵀ + mask) v`` ``[B, Hq, Nq, Dv]``
    in q's dtype (an empty tensor when ``need_out`` is False or v is None) and the column sums
    ``score[b, h, j] = Σ_i P[b, h, i, j]`` ``[B, Hq, Nk]`` float32.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..codegen import attention as attention_kernels
from ..codegen import h2o as kernels


def _empty(like: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=like.dtype, device=like.device)


@torch.library.custom_op("fuser::h2o", mutates_args=())
def h2o(
    q: torch.Tensor,
    k: torch.Tensor,
    v: Optional[torch.Tensor],
    mask: Optional[torch.Tensor],
    scale: float,
    causal: str,
    mask_kind: str,
    need_out: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    want_out = need_out and v is not None
    out, score = kernels.forward(q, k, v if want_out else None, scale=scale, causal=causal, mask=mask,
                                 mask_kind=mask_kind, need_out=want_out)
    return (out if out is not None else _empty(q)), score


@h2o.register_fake
def _h2o_fake(q, k, v, mask, scale, causal, mask_kind, need_out):
    b, hq, n_q, _ = q.shape
    n_k = k.shape[2]
    score = q.new_empty((b, hq, n_k), dtype=torch.float32)
    if not (need_out and v is not None):
        return _empty(q), score
    return attention_kernels.alloc_out(q, v), score  # the attention forward's output layout
