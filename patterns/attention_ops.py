"""The fused attention ops: ``torch.ops.fuser.attention`` and its backward.

Both are ``torch.library.custom_op`` s with fake (meta) implementations, so Dynamo, AOTAutograd
and Inductor treat them as opaque kernels with known output shapes and strides; the forward
registers its autograd formula, which calls the backward op. Neither op mutates or aliases
its inputs. The kernels themselves are in ``codegen/attention.py``.

``torch.ops.fuser.attention(q, k, v, mask, scale, causal, mask_kind, need_lse, plan, mask_fill, causal_fill, causal_fill_mode, pred, pred_consts, pred_fill, pred_fill_mode) -> (out, lse)``
    q ``[B, Hq, Nq, D]``, k ``[B, Hkv, Nk, D]``, v ``[B, Hkv, Nk, Dv]`` (any strides; GQA when
    ``Hkv < Hq``); ``mask`` broadcastable to ``[B, Hq, Nq, Nk]`` or None; ``causal`` in
    ``{"none", "top_left", "bottom_right"}``; ``mask_kind`` in ``{"none", "bool_keep",
    "bool_drop", "additive"}``; ``need_lse`` False for inference (``lse`` is then an empty
    tensor); ``plan`` a ``"key=value;..."`` string (``backward=two_kernel|atomic_dq|autotune``,
    ``autotune=0|1``); ``mask_fill`` the score of a boolean mask's hidden entries (ignored by
    other mask kinds); ``causal_fill`` with ``causal_fill_mode`` ``"replace"|"add"`` the score of
    (or what is added to) the entries above the causal diagonal (ignored without causal); ``-inf``
    fills hide the entries (the kernels without fills); ``pred`` an index predicate over query i
    and key j in ``codegen/predicate.py``'s text (e.g. ``and(ge(1,-1,0),ge(-1,1,1))``: ``i - j +
    C0 >= 0 and j - i + C1 >= 0``), ``""`` for none, with its integer constants ``pred_consts``
    (SymInts: sizes, window widths; runtime kernel arguments) — a key it drops for a row scores
    ``pred_fill`` (``pred_fill_mode="replace"``) or ``s + pred_fill`` (``"add"``), ``-inf``
    hiding it (key tiles that a whole query block drops are skipped); applied after the masks;
    not with ``causal != "none"``. Returns ``out`` ``[B, Hq, Nq, Dv]`` in q's
    dtype (memory laid out ``[B, Nq, Hq, Dv]``) and the softmax statistics float32, contiguous:
    the base-2 ``lse`` ``[B, Hq, Nq]``, or where a row's max can be a huge finite value (an
    additive mask, a finite fill that applies: ``codegen.attention.two_part_stats``) the two-part
    statistics ``[B, Hq, 2, Nq]`` (row max m2, then log2 l).

``torch.ops.fuser.attention_backward(dout, q, k, v, out, lse, mask, scale, causal, mask_kind, plan, needs, mask_fill, causal_fill, causal_fill_mode, pred, pred_consts, pred_fill, pred_fill_mode) -> (dq, dk, dv)``
    gradients for the inputs flagged in ``needs`` (empty tensors for the others).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..codegen import attention as kernels
from ..codegen import launch, predicate, variants


def parse_plan(plan: str) -> dict:
    """``"backward=two_kernel;autotune=1"`` -> ``{"backward": "two_kernel", "autotune": "1"}``."""
    out = {}
    for part in plan.split(";"):
        if part:
            k, _, v = part.partition("=")
            out[k] = v
    return out


def _none_tensor(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty((0,), dtype=torch.float32)


def _fill_tag(causal: str, mask_kind: str, fills: dict) -> str:
    """The fill kinds and predicate of a variant for tuning keys ("" without finite fills or a
    predicate: keys as before)."""
    mask_k = variants.mask_fill_kind(mask_kind, fills["mask_fill"])
    causal_k = variants.causal_fill_kind(causal, fills["causal_fill"], fills["causal_fill_mode"])
    tag = "" if mask_k == causal_k == "hide" else f"|fill:{mask_k}/{causal_k}"
    pred = kernels.as_predicate(fills.get("mask_pred"))
    if pred is not None:
        pred_k = variants.fill_kind(True, fills["pred_fill"], fills["pred_fill_mode"])
        tag += f"|pred:{predicate.serialize(pred)}/{pred_k}"
    return tag


def _tune_key(kind: str, q, k, v, mask, causal: str, mask_kind: str, extra: str = "") -> str:
    # Sequence lengths are bucketed to powers of two: one tuning per bucket, not per length.
    b, hq, nq, d = q.shape
    hkv, nk, dv = k.shape[1], k.shape[2], v.shape[-1]
    return (
        f"attention.{kind}|{launch.gpu_name(q.device)}|{q.dtype}|B{b}|H{hq}/{hkv}|"
        f"Nq{launch.next_power_of_2(nq)}|Nk{launch.next_power_of_2(nk)}|D{d}/{dv}|{causal}|{mask_kind}{extra}"
    )


def _fills(mask_fill: float = float("-inf"), causal_fill: float = float("-inf"), causal_fill_mode: str = "replace",
           pred: str = "", pred_consts=(), pred_fill: float = float("-inf"), pred_fill_mode: str = "replace") -> dict:
    """The kernels' fill and predicate keyword arguments (``pred_consts`` as plain ints)."""
    return dict(mask_fill=mask_fill, causal_fill=causal_fill, causal_fill_mode=causal_fill_mode,
                mask_pred=pred or None, pred_consts=tuple(int(c) for c in pred_consts), pred_fill=pred_fill,
                pred_fill_mode=pred_fill_mode)


def tuned_forward_config(q, k, v, mask, scale, causal, mask_kind, fills: Optional[dict] = None) -> dict:
    """The fastest forward config for this problem, timed on first use (see launch.autotune)."""
    fills = fills or _fills()
    n_ctx = kernels.context_length(q.shape[-2], k.shape[-2])
    cands = kernels.candidate_configs(
        head_dim=q.shape[-1], head_dim_v=v.shape[-1], dtype=q.dtype, device=q.device, causal=causal, kind="fwd",
        n_ctx=n_ctx,
    )
    if launch.interpreted(q.device) or len(cands) == 1:
        return cands[0]

    def run(cfg, q, k, v, mask):
        kernels.forward(q, k, v, scale=scale, causal=causal, mask=mask, mask_kind=mask_kind, need_lse=True, config=cfg,
                        **fills)

    short = "|short" if variants.is_causal(causal) and kernels.short_causal(n_ctx) else ""  # its own candidates
    key = _tune_key("fwd", q, k, v, mask, causal, mask_kind, _fill_tag(causal, mask_kind, fills) + short)
    return launch.autotune(key, cands, run, inputs=(q, k, v, mask))


def tuned_backward(dout, q, k, v, out, lse, mask, scale, causal, mask_kind, needs, mode,
                   fills: Optional[dict] = None) -> tuple[str, dict]:
    """The fastest (backward mode, config); ``mode="autotune"`` also times both modes (only
    ``two_kernel`` under ``torch.use_deterministic_algorithms(True)``: atomic dQ is not
    deterministic)."""
    fills = fills or _fills()
    cands = kernels.candidate_configs(
        head_dim=q.shape[-1], head_dim_v=v.shape[-1], dtype=q.dtype, device=q.device, causal=causal, kind="bwd"
    )
    if mode == "autotune":
        modes = ["two_kernel"] if torch.are_deterministic_algorithms_enabled() else ["two_kernel", "atomic_dq"]
    else:
        modes = [mode]
    pairs = [dict(cfg, bwd_mode=m) for m in modes for cfg in cands]
    if launch.interpreted(q.device) or len(pairs) == 1:
        best = pairs[0]
    else:
        def run(cfg, dout, q, k, v, out, lse, mask):
            c = dict(cfg)
            m = c.pop("bwd_mode")
            kernels.backward(dout, q, k, v, out, lse, scale=scale, causal=causal, mask=mask, mask_kind=mask_kind,
                             bwd_mode=m, needs_grad=needs, config=c, **fills)

        extra = f"|needs{''.join(str(int(x)) for x in needs)}|{'+'.join(modes)}{_fill_tag(causal, mask_kind, fills)}"
        best = launch.autotune(_tune_key("bwd", q, k, v, mask, causal, mask_kind, extra), pairs, run,
                               inputs=(dout, q, k, v, out, lse, mask))
    best = dict(best)
    return best.pop("bwd_mode"), best


def _symbolic_sizes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: str) -> Optional[str]:
    """Why an attention op's call with symbolic sizes (dynamic shapes: a batch or a length that
    changed between calls) keeps the opaque op, or None: its kernels and launch configs are
    chosen from the dtype, the head dims and the variant, never from B or N (a symbolic length
    takes the long-sequence config tables, :func:`codegen.attention.short_causal`), so the
    launches traced once serve every batch and length. Not so for autotuning (keyed and timed
    per length bucket), symbolic head dims (the config tables' keys) or head counts (the GQA
    grouping ``Hq % Hkv``), nor rows (B·Hq, one grid axis) that may exceed one launch grid
    (:func:`codegen.launch.at_most`). Checked by tests/patterns/test_inline_ops.py: no guard,
    no specialised size, for every variant with a symbolic batch and symbolic lengths."""
    p = parse_plan(plan)
    if p.get("autotune") == "1" or p.get("backward") == "autotune":
        return "autotuning, timed per length"
    return launch.symbolic_launch_fits((q.shape[1], k.shape[1], q.shape[-1], v.shape[-1]), q.shape[0] * q.shape[1])


def _symbolic_forward(args, kwargs) -> Optional[str]:
    """The ``symbolic`` rule (``launch.fused_op``) of :func:`attention`: :func:`_symbolic_sizes`."""
    return _symbolic_sizes(args[0], args[1], args[2], args[8])


def _symbolic_backward(args, kwargs) -> Optional[str]:
    """The ``symbolic`` rule of :func:`attention_backward`: :func:`_symbolic_sizes`."""
    return _symbolic_sizes(args[1], args[2], args[3], args[10])


@launch.fused_op("fuser::attention", symbolic=_symbolic_forward)
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Optional[torch.Tensor],
    scale: float,
    causal: str,
    mask_kind: str,
    need_lse: bool,
    plan: str,
    mask_fill: float,
    causal_fill: float,
    causal_fill_mode: str,
    pred: str,
    pred_consts: list[int],
    pred_fill: float,
    pred_fill_mode: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    p = parse_plan(plan)
    fills = _fills(mask_fill, causal_fill, causal_fill_mode, pred, pred_consts, pred_fill, pred_fill_mode)
    out, lse = kernels.forward(
        q, k, v, scale=scale, causal=causal, mask=mask, mask_kind=mask_kind, need_lse=need_lse,
        config=tuned_forward_config(q, k, v, mask, scale, causal, mask_kind, fills) if p.get("autotune") == "1" else None,
        **fills,
    )
    return out, (lse if lse is not None else _none_tensor(q))


@attention.register_fake
def _attention_fake(q, k, v, mask, scale, causal, mask_kind, need_lse, plan, mask_fill, causal_fill, causal_fill_mode,
                    pred, pred_consts, pred_fill, pred_fill_mode):
    out = kernels.alloc_out(q, v)
    if not need_lse:
        return out, _none_tensor(q)
    two_part = kernels.two_part_stats(causal=causal, mask_kind=mask_kind, mask_fill=mask_fill,
                                      causal_fill=causal_fill, causal_fill_mode=causal_fill_mode,
                                      mask_pred=pred or None, pred_fill=pred_fill, pred_fill_mode=pred_fill_mode)
    return out, kernels.alloc_lse(q, two_part)


@launch.fused_op("fuser::attention_backward", symbolic=_symbolic_backward)
def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mask: Optional[torch.Tensor],
    scale: float,
    causal: str,
    mask_kind: str,
    plan: str,
    needs: list[bool],
    mask_fill: float,
    causal_fill: float,
    causal_fill_mode: str,
    pred: str,
    pred_consts: list[int],
    pred_fill: float,
    pred_fill_mode: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if lse.numel() == 0 and q.numel() != 0:
        raise RuntimeError(
            "fuser: attention backward called on a forward that stored no LSE (compiled for "
            "inference); this is a fuser bug, please report it"
        )
    p = parse_plan(plan)
    fills = _fills(mask_fill, causal_fill, causal_fill_mode, pred, pred_consts, pred_fill, pred_fill_mode)
    mode = p.get("backward", "two_kernel")
    config = None
    if mode == "autotune" or p.get("autotune") == "1":
        mode, config = tuned_backward(dout, q, k, v, out, lse, mask, scale, causal, mask_kind, tuple(needs), mode, fills)
    dq, dk, dv = kernels.backward(
        dout, q, k, v, out, lse, scale=scale, causal=causal, mask=mask, mask_kind=mask_kind,
        bwd_mode=mode, needs_grad=tuple(needs), config=config, **fills,
    )
    return (
        dq if dq is not None else _none_tensor(q),
        dk if dk is not None else _none_tensor(k),
        dv if dv is not None else _none_tensor(v),
    )


@attention_backward.register_fake
def _attention_backward_fake(dout, q, k, v, out, lse, mask, scale, causal, mask_kind, plan, needs,
                             mask_fill, causal_fill, causal_fill_mode, pred, pred_consts, pred_fill, pred_fill_mode):
    dq, dk, dv = kernels.alloc_grads(q, k, v, tuple(needs))
    return (
        dq if dq is not None else _none_tensor(q),
        dk if dk is not None else _none_tensor(k),
        dv if dv is not None else _none_tensor(v),
    )


# q, k, v, mask, scale, causal, mask_kind, need_lse, plan, mask_fill, causal_fill, causal_fill_mode,
# pred, pred_consts, pred_fill, pred_fill_mode
_N_INPUTS = 16


def _setup_context(ctx, inputs, output):
    (q, k, v, mask, scale, causal, mask_kind, need_lse, plan, mask_fill, causal_fill, causal_fill_mode,
     pred, pred_consts, pred_fill, pred_fill_mode) = inputs
    out, lse = output
    # Save only what the backward needs: dV = Pᵀ dO needs q, k and the statistics (P is
    # recomputed), not v or out; those (dP = dO vᵀ, delta = rowsum(dO ∘ out)) serve dQ and dK only.
    dv_only = not (ctx.needs_input_grad[0] or ctx.needs_input_grad[1])
    ctx.placeholders = ((tuple(v.shape), v.dtype), (tuple(out.shape), out.dtype)) if dv_only else None
    if dv_only:
        ctx.save_for_backward(q, k, None, None, lse, mask)
    else:
        ctx.save_for_backward(q, k, v, out, lse, mask)
    ctx.params = (scale, causal, mask_kind, plan, mask_fill, causal_fill, causal_fill_mode,
                  pred, list(pred_consts), pred_fill, pred_fill_mode)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, mask = ctx.saved_tensors
    if ctx.placeholders is not None:
        # dV only: the kernels take v and out operands but read neither for dV (their values
        # reach dQ and dK alone); zeros of the right shape stand in for them
        (v_shape, v_dtype), (out_shape, out_dtype) = ctx.placeholders
        v = q.new_zeros(v_shape, dtype=v_dtype)
        out = q.new_zeros(out_shape, dtype=out_dtype)
    (scale, causal, mask_kind, plan, mask_fill, causal_fill, causal_fill_mode,
     pred, pred_consts, pred_fill, pred_fill_mode) = ctx.params
    needs = [bool(x) for x in ctx.needs_input_grad[:3]]
    if not any(needs):
        return (None,) * _N_INPUTS
    dq, dk, dv = torch.ops.fuser.attention_backward(
        dout, q, k, v, out, lse, mask, scale, causal, mask_kind, plan, needs, mask_fill, causal_fill, causal_fill_mode,
        pred, pred_consts, pred_fill, pred_fill_mode,
    )
    return (
        dq if needs[0] else None,
        dk if needs[1] else None,
        dv if needs[2] else None,
    ) + (None,) * (_N_INPUTS - 3)


attention.register_autograd(_backward, setup_context=_setup_context)


# DTensor sharding rules (fuser/distributed.py): batch and heads are independent problems.
from fuser import distributed  # noqa: E402


def _stats_dims(lse) -> str:
    return "bhi" if len(lse.shape) == 3 else "bhxi"  # [B, H, Nq] or two-part [B, H, 2, Nq]


def _sharding_fwd(q, k, v, mask, need_lse, causal, mask_kind, mask_fill, causal_fill, causal_fill_mode, pred,
                  pred_fill, pred_fill_mode, **_):
    two = kernels.two_part_stats(causal=causal, mask_kind=mask_kind, mask_fill=mask_fill, causal_fill=causal_fill,
                                 causal_fill_mode=causal_fill_mode, mask_pred=pred or None, pred_fill=pred_fill,
                                 pred_fill_mode=pred_fill_mode)
    ins = {"q": "bhid", "k": "bhjd", "v": "bhje", "mask": distributed.broadcast_dims(mask, "bhij")}
    return distributed.Layout(ins, ("bhie", ("bhxi" if two else "bhi") if need_lse else None), "bh")


def _sharding_bwd(dout, q, k, v, out, lse, mask, needs, **_):
    ins = {"dout": "bhie", "q": "bhid", "k": "bhjd", "v": "bhje", "out": "bhie", "lse": _stats_dims(lse),
           "mask": distributed.broadcast_dims(mask, "bhij")}
    return distributed.Layout(ins, tuple(d if n else None for d, n in zip(("bhid", "bhjd", "bhje"), needs)), "bh")


distributed.register_op_sharding(attention, _sharding_fwd)
distributed.register_op_sharding(attention_backward, _sharding_bwd)
