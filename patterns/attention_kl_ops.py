"""The fused attention-KL ops: ``torch.ops.fuser.attention_kl`` and its backward.

``torch.ops.fuser.attention_kl(q1, k1, q2, k2, mask, scale1, scale2, causal, mask_kind, need_stats, plan, mask_fill1, mask_fill2, causal_fill1, causal_fill2, causal_fill_mode, zero_hidden) -> (rows, lse1, lse2, delta)``
    Side 1 is the target distribution P1 (the teacher), side 2 the student P2.
    q1 ``[B, H, Nq, D1]``, k1 ``[B, Hkv1, Nk, D1]``, q2 ``[B, H, Nq, D2]``, k2 ``[B, Hkv2, Nk, D2]``
    (any strides; GQA per side); ``mask`` broadcastable to ``[B, H, Nq, Nk]`` (shared by both
    sides) or None. ``mask_fill1``/``mask_fill2``: the score (natural units, what each side's
    softmax sees) a boolean mask's hidden entry takes on each side (``-inf``: hidden);
    ``causal_fill1``/``causal_fill2`` with ``causal_fill_mode`` ``"replace"`` or ``"add"``: the
    score an entry above the causal diagonal takes, or gets added (``-inf``: hidden). All
    ``-inf`` is the behaviour without fills. Returns ``rows`` ``[B, H, Nq]`` float32,
    ``L_i = Σ_j P1 (log P1 − log P2)`` in nats (0 for a row with no visible key), and the
    per-row statistics the backward needs, float32, base 2: ``lse1, lse2, delta`` ``[B, H, Nq]``;
    or, for an additive mask or a finite fill (``kernels.two_part_stats``), ``lse1, lse2``
    ``[2, B, H, Nq]`` (per side the row max and log2 of the row sum) and the offset-free
    ``delta`` ``[B, H, Nq]``; empty tensors when ``need_stats`` is false.
    ``plan``: ``"split_k=<n>;backward=two_kernel|atomic_dq"``.
    ``zero_hidden``: the KL terms of the entries the boolean mask or the causal structure hides
    are zeroed (``kl_div(...).masked_fill(m, 0)``): ``L_i`` sums the visible keys only, the
    hidden ones still count in both softmaxes. It changes something only with a finite fill
    (``kernels.zero_hidden_flag``); then ``lse1`` is ``[4, B, H, Nq]`` (adding the teacher's
    hidden and visible mass) and ``delta`` the zero_hidden form (``kernels.forward``).

``torch.ops.fuser.attention_kl_backward(g, q1, k1, q2, k2, lse1, lse2, delta, mask, scale1, scale2, causal, mask_kind, plan, needs, mask_fill1, mask_fill2, causal_fill1, causal_fill2, causal_fill_mode, zero_hidden) -> (dq1, dk1, dq2, dk2)``
    gradients for the inputs flagged in ``needs`` (empty tensors for the others), given the
    upstream gradient ``g`` of ``rows``.

Neither op mutates or aliases its inputs; both have fake implementations with the real
outputs' strides. Kernels: ``codegen/attention_kl.py``.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..codegen import attention_kl as kernels
from ..codegen import launch
from .attention_ops import parse_plan


def _empty_stat(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty((0,), dtype=torch.float32)


def _symbolic_sizes(q1, k1, k2, mask, plan: str, key: str, serves: str, why: str) -> Optional[str]:
    """Why an attention-KL op's call with symbolic sizes keeps the opaque op, or None: the plan's
    ``key`` must be ``serves`` (else ``why``), no mask tensor, static head dims and head counts
    (they pick the kernels' configs), and rows (B·H) that fit one launch grid for every size
    (``launch.symbolic_launch_fits``)."""
    if parse_plan(plan).get(key, serves) != serves:
        return why
    if mask is not None:
        return "a mask tensor"
    return launch.symbolic_launch_fits((q1.shape[-1], k2.shape[-1], q1.shape[1], k1.shape[1], k2.shape[1]),
                                       q1.shape[0] * q1.shape[1])


def _symbolic_forward(args, kwargs) -> Optional[str]:
    """The ``symbolic`` rule (``launch.fused_op``) of :func:`attention_kl`: the one-pass forward
    (``split_k=1``: its launch config depends on the head dims only) with no mask tensor (causal
    or none) serves a symbolic batch and symbolic lengths without a guard beyond the rows'; a
    split over the keys is sized from the lengths and keeps the opaque op. Checked by
    tests/patterns/test_inline_ops.py (the guards a trace adds)."""
    return _symbolic_sizes(args[0], args[1], args[3], args[4], args[10], "split_k", "1",
                           "a split over the keys, sized from the lengths")


def _symbolic_backward(args, kwargs) -> Optional[str]:
    """The ``symbolic`` rule of :func:`attention_kl_backward`: the two-kernel backward (configs
    from the head dims; the atomic-dQ backward of 16-bit inputs splits its launches by B and H)
    with no mask tensor, as :func:`_symbolic_forward`."""
    return _symbolic_sizes(args[1], args[2], args[4], args[8], args[13], "backward", "two_kernel",
                           "the atomic-dQ backward, split by batch and heads")


@launch.fused_op("fuser::attention_kl", symbolic=_symbolic_forward)
def attention_kl(
    q1: torch.Tensor,
    k1: torch.Tensor,
    q2: torch.Tensor,
    k2: torch.Tensor,
    mask: Optional[torch.Tensor],
    scale1: float,
    scale2: float,
    causal: str,
    mask_kind: str,
    need_stats: bool,
    plan: str,
    mask_fill1: float,
    mask_fill2: float,
    causal_fill1: float,
    causal_fill2: float,
    causal_fill_mode: str,
    zero_hidden: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    p = parse_plan(plan)
    split = p.get("split_k", "1")
    split_k = kernels.default_split_k(q1.shape[0], q1.shape[1], q1.shape[2], k1.shape[2], q1.device) if split == "auto" else int(split)
    rows, lse1, lse2, delta = kernels.forward(
        q1, k1, q2, k2, scale1=scale1, scale2=scale2, causal=causal, mask=mask, mask_kind=mask_kind,
        need_stats=need_stats, split_k=split_k, mask_fill1=mask_fill1, mask_fill2=mask_fill2,
        causal_fill1=causal_fill1, causal_fill2=causal_fill2, causal_fill_mode=causal_fill_mode,
        zero_hidden=zero_hidden,
    )
    if not need_stats:  # three distinct tensors: custom-op outputs may not alias each other
        lse1, lse2, delta = _empty_stat(q1), _empty_stat(q1), _empty_stat(q1)
    return rows, lse1, lse2, delta


def _stat_planes(causal, mask_kind, mask_fill1, mask_fill2, causal_fill1, causal_fill2, causal_fill_mode,
                 zero_hidden) -> tuple[int, int]:
    fills = kernels.fill_variant(causal, mask_kind, mask_fill1, mask_fill2, causal_fill1, causal_fill2, causal_fill_mode)
    return kernels.stat_planes(mask_kind, **fills, zero_hidden=zero_hidden)


@attention_kl.register_fake
def _attention_kl_fake(q1, k1, q2, k2, mask, scale1, scale2, causal, mask_kind, need_stats, plan,
                       mask_fill1, mask_fill2, causal_fill1, causal_fill2, causal_fill_mode, zero_hidden):
    rows = kernels.alloc_rows(q1)
    if not need_stats:
        return rows, _empty_stat(q1), _empty_stat(q1), _empty_stat(q1)
    p1, p2 = _stat_planes(causal, mask_kind, mask_fill1, mask_fill2, causal_fill1, causal_fill2, causal_fill_mode,
                          zero_hidden)
    return rows, kernels.alloc_stats(q1, p1 > 0, p1), kernels.alloc_stats(q1, p2 > 0, p2), kernels.alloc_stats(q1)


@launch.fused_op("fuser::attention_kl_backward", symbolic=_symbolic_backward)
def attention_kl_backward(
    g: torch.Tensor,
    q1: torch.Tensor,
    k1: torch.Tensor,
    q2: torch.Tensor,
    k2: torch.Tensor,
    lse1: torch.Tensor,
    lse2: torch.Tensor,
    delta: torch.Tensor,
    mask: Optional[torch.Tensor],
    scale1: float,
    scale2: float,
    causal: str,
    mask_kind: str,
    plan: str,
    needs: list[bool],
    mask_fill1: float,
    mask_fill2: float,
    causal_fill1: float,
    causal_fill2: float,
    causal_fill_mode: str,
    zero_hidden: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if lse1.numel() == 0 and q1.numel() != 0:
        raise RuntimeError("fuser: attention_kl backward on a forward that stored no statistics; a fuser bug")
    p = parse_plan(plan)
    grads = kernels.backward(
        g, q1, k1, q2, k2, lse1, lse2, delta, scale1=scale1, scale2=scale2, causal=causal, mask=mask,
        mask_kind=mask_kind, needs_grad=tuple(needs), bwd_mode=p.get("backward", "two_kernel"),
        mask_fill1=mask_fill1, mask_fill2=mask_fill2, causal_fill1=causal_fill1, causal_fill2=causal_fill2,
        causal_fill_mode=causal_fill_mode, zero_hidden=zero_hidden,
    )
    likes = (q1, k1, q2, k2)
    return tuple(x if x is not None else _empty_stat(like) for x, like in zip(grads, likes))


@attention_kl_backward.register_fake
def _attention_kl_backward_fake(g, q1, k1, q2, k2, lse1, lse2, delta, mask, scale1, scale2, causal, mask_kind, plan, needs,
                                mask_fill1, mask_fill2, causal_fill1, causal_fill2, causal_fill_mode, zero_hidden):
    grads = kernels.alloc_grads(q1, k1, q2, k2, tuple(needs))
    likes = (q1, k1, q2, k2)
    return tuple(x if x is not None else _empty_stat(like) for x, like in zip(grads, likes))


def _setup_context(ctx, inputs, output):
    q1, k1, q2, k2, mask, scale1, scale2, causal, mask_kind, need_stats, plan, *fills = inputs
    _, lse1, lse2, delta = output
    ctx.save_for_backward(q1, k1, q2, k2, lse1, lse2, delta, mask)
    ctx.params = (scale1, scale2, causal, mask_kind, plan)
    ctx.fills = tuple(fills)  # mask_fill1, mask_fill2, causal_fill1, causal_fill2, causal_fill_mode, zero_hidden


_N_INPUTS = 17


def _backward(ctx, g_rows, g_lse1, g_lse2, g_delta):
    q1, k1, q2, k2, lse1, lse2, delta, mask = ctx.saved_tensors
    scale1, scale2, causal, mask_kind, plan = ctx.params
    needs = [bool(x) for x in ctx.needs_input_grad[:4]]
    if not any(needs) or g_rows is None:
        return (None,) * _N_INPUTS
    grads = torch.ops.fuser.attention_kl_backward(
        g_rows, q1, k1, q2, k2, lse1, lse2, delta, mask, scale1, scale2, causal, mask_kind, plan, needs, *ctx.fills
    )
    return tuple(gr if need else None for gr, need in zip(grads, needs)) + (None,) * (_N_INPUTS - 4)


attention_kl.register_autograd(_backward, setup_context=_setup_context)


# DTensor sharding rules (fuser/distributed.py): batch and heads are independent problems.
from fuser import distributed  # noqa: E402


def _stats_dims(x) -> "str | None":
    # [B, H, Nq], or one side's two-part statistics [planes, B, H, Nq]; an empty placeholder
    return None if x is None or len(x.shape) == 1 else ("bhi" if len(x.shape) == 3 else "xbhi")


def _sharding_fwd(q1, k1, q2, k2, mask, causal, mask_kind, need_stats, mask_fill1, mask_fill2, causal_fill1,
                  causal_fill2, causal_fill_mode, zero_hidden, **_):
    ins = {"q1": "bhid", "k1": "bhjd", "q2": "bhie", "k2": "bhje", "mask": distributed.broadcast_dims(mask, "bhij")}
    if not need_stats:
        return distributed.Layout(ins, ("bhi", None, None, None), "bh")
    p1, p2 = _stat_planes(causal, mask_kind, mask_fill1, mask_fill2, causal_fill1, causal_fill2, causal_fill_mode,
                          zero_hidden)
    return distributed.Layout(ins, ("bhi", "xbhi" if p1 > 0 else "bhi", "xbhi" if p2 > 0 else "bhi", "bhi"), "bh")


def _sharding_bwd(g, q1, k1, q2, k2, lse1, lse2, delta, mask, needs, **_):
    ins = {"g": "bhi", "q1": "bhid", "k1": "bhjd", "q2": "bhie", "k2": "bhje", "lse1": _stats_dims(lse1),
           "lse2": _stats_dims(lse2), "delta": _stats_dims(delta), "mask": distributed.broadcast_dims(mask, "bhij")}
    outs = tuple(d if n else None for d, n in zip(("bhid", "bhjd", "bhie", "bhje"), needs))
    return distributed.Layout(ins, outs, "bh")


distributed.register_op_sharding(attention_kl, _sharding_fwd)
distributed.register_op_sharding(attention_kl_backward, _sharding_bwd)
