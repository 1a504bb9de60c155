"""Plans for an attention-KL match — their symbolic costs — and the graph code each emits.

Per visible (query, key) pair the forward computes two score dot products (``2·D1 + 2·D2``
FLOPs) and two exponentials, and keeps only O(N) statistics; it never materialises P1 or P2.

``fuser[split_k=1|auto, backward=two_kernel|atomic_dq]``
    forward in one pass per query block (``split_k=1``) or split over keys with the exact merge
    (``auto``: enough splits to fill the GPU when ``B·H·Nq`` is small). Backward as a dK kernel
    plus a dQ kernel, each recomputing P1 and P2 (deterministic; ``8·(D1 + D2)`` FLOPs per pair
    with both sides trainable, ``4·D1 + 8·D2`` with a frozen teacher), or one kernel with
    atomic dQ (``6·(D1 + D2)``, frozen teacher ``2·D1 + 6·D2``).
``inductor``
    leave the region to Inductor (CUDA only): S1, S2 and the log-probabilities materialised.
"""

from __future__ import annotations

import operator

import sympy
import torch
import torch.fx as fx

from fuser import costmodel as cm
from fuser.codegen import launch
from fuser.graph import permuted, val
from fuser.pattern import Candidate, Match, MatchContext
from fuser.static import symint_value

from . import attention_kl_ops  # noqa: F401  (registers torch.ops.fuser.attention_kl)
from .scores import Emitter
from . import planning

BLOCK_M, BLOCK_N = 128, 64  # nominal tiles for tile counts in the cost model
D1, D2, HKV1, HKV2 = sympy.symbols("D_1 D_2 H_kv1 H_kv2", positive=True, integer=True)


def _subs(m: Match) -> dict:
    b = m.bindings
    s1, s2 = b["s1"], b["s2"]

    def four(x, perm):
        s = [int(symint_value(v)) for v in permuted(val(x).shape, perm)]
        return [1] * (4 - len(s)) + s

    q1, k1 = four(s1.q, s1.q_p), four(_k(s1), s1.k_p)
    q2, k2 = four(s2.q, s2.q_p), four(_k(s2), s2.k_p)
    return {cm.B: q1[0], cm.H: q1[1], cm.NQ: q1[2], cm.NK: k1[2], D1: q1[3], D2: q2[3], HKV1: k1[1], HKV2: k2[1]}


def _k(s):
    """The k operand the kernels read: the un-repeated heads when GQA was undone."""
    return s.k_ungrouped if s.group > 1 and s.k_p is None else s.k


def cost_terms(m: Match, impl: str, split: bool, backward: str | None) -> dict:
    """Symbolic cost terms of one candidate (see the module docstring)."""
    b = m.bindings
    elt = b["in_dtype"].itemsize
    if b["causal"] == "none":
        pairs = cm.NQ * cm.NK
    else:
        pairs = cm.pairs_causal(cm.NQ, cm.NK, 0 if b["causal"] == "top_left" else cm.NK - cm.NQ)
    bh = cm.B * cm.H
    io = elt * (bh * cm.NQ * (D1 + D2) + cm.B * cm.NK * (HKV1 * D1 + HKV2 * D2))
    mask_bytes = 0
    for t in b["mask_terms"]:
        mv = val(t["node"])
        mask_bytes += int(symint_value(mv.numel())) * mv.element_size()
    if impl == "inductor":
        dense = bh * cm.NQ * cm.NK
        terms = {"flops": 2 * dense * (D1 + D2), "bytes": io + dense * (4 * elt + 6 * 4) + mask_bytes,
                 "exps": 4 * dense, "launches": 6}
        if backward:
            terms["flops"] = terms["flops"] * 3
            terms["bytes"] = terms["bytes"] * 3
            terms["launches"] = 14
        return terms
    tiles = sympy.ceiling(cm.NQ / BLOCK_M) * bh
    terms = {
        "flops": 2 * bh * pairs * (D1 + D2),
        "bytes": io + 4 * 4 * bh * cm.NQ + mask_bytes,
        "exps": 2 * bh * pairs,
        "tiles": tiles,
        "launches": 1,
    }
    if split:
        # enough key splits for ~2 waves on 132 SMs, at least 4 key tiles each
        s = sympy.Max(1, sympy.Min(sympy.ceiling(264 / tiles), sympy.floor(cm.NK / (4 * BLOCK_N)), 16))
        terms["tiles"] = tiles * s
        terms["bytes"] = terms["bytes"] + 2 * 5 * 4 * bh * cm.NQ * s
        terms["launches"] = 2
    if backward:
        both = b["grad_teacher"]
        if backward == "two_kernel":
            terms["bwd_flops"] = bh * pairs * (8 * (D1 + D2) if both else 4 * D1 + 8 * D2)
            terms["bwd_exps"] = 4 * bh * pairs
        else:
            terms["bwd_flops"] = bh * pairs * (6 * (D1 + D2) if both else 2 * D1 + 6 * D2)
            terms["bwd_exps"] = 2 * bh * pairs
            terms["atomics"] = bh * cm.NQ * ((D1 + D2) if both else D2) * sympy.ceiling(cm.NK / BLOCK_N)
        terms["bwd_bytes"] = 2 * io + 4 * 4 * bh * cm.NQ + mask_bytes
        terms["bwd_tiles"] = sympy.ceiling(cm.NK / BLOCK_N) * cm.B * HKV2
    return terms


# Fraction of the bf16 matrix-unit peak fuser's attention-KL kernels reach, by head-dim bucket
# (<=64, <=128, <=256). benchmarks/tune_attention_kl.py, H100, N=8192, B=1, H=16, bf16, the
# tuned tables; 2026-11-21: forward 297 / 369 / 376 TFLOP/s at D=64 / 128 / 256 (causal
# 264 / 321 / 307); backward counted as the cost terms do (two_kernel frozen 12·D per pair:
# 357 / 411 / 432, both sides 16·D: 331 / 428 / 184 — at D=256 the two dK accumulators of the
# trainable-teacher kernel cost half the speed; the bucket's value is in between).
EFFICIENCY_FWD = (0.37, 0.45, 0.45)
EFFICIENCY_BWD = (0.44, 0.52, 0.35)


def _estimate(terms: dict, subs: dict, model: cm.DeviceModel, kind: str, impl: str) -> float:
    d = max(subs[D1], subs[D2])
    if impl == "inductor":
        return cm.estimate_ms(terms, subs, model, kind, cm.efficiency(cm.EAGER_MATMUL, d))
    fwd = {k: terms[k] for k in ("flops", "bytes", "exps", "tiles", "launches") if k in terms}
    t = cm.estimate_ms(fwd, subs, model, kind, cm.efficiency(EFFICIENCY_FWD, d))
    if "bwd_flops" in terms:
        bwd = {"flops": terms["bwd_flops"], "bytes": terms["bwd_bytes"], "exps": terms["bwd_exps"],
               "tiles": terms["bwd_tiles"], "launches": 2 if "atomics" not in terms else 1}
        t += cm.estimate_ms(bwd, subs, model, kind, cm.efficiency(EFFICIENCY_BWD, d))
        t += cm.atomics_ms(terms, subs, model)
    return t


def candidates(m: Match, ctx: MatchContext) -> list[Candidate]:
    """Every plan this match can run with, each with its estimate at the example shapes."""
    b = m.bindings
    dev = b["device"]
    model = planning.device_model(dev, ctx)
    subs = _subs(m)
    kind = cm.operand_kind(str(b["in_dtype"]), launch.dot_precision(b["in_dtype"]) == "tf32")
    forced_split = ctx.options.forced("attention_kl", "split_k")
    splits = ["1", forced_split] if forced_split and forced_split != "1" else ["1", "auto"]
    modes = ("two_kernel", "atomic_dq") if b["need_stats"] else (None,)
    out = []
    for split in splits:
        for mode in modes:
            terms = cost_terms(m, "fuser", split != "1", mode)
            params = {"impl": "fuser", "split_k": split}
            name = f"fuser[split_k={split}"
            if mode:
                params["backward"] = mode
                name += f", backward={mode}"
            note = "streaming KL, never materialises P1/P2" + ("" if split == "1" else "; keys split with an exact merge")
            out.append(Candidate(name + "]", params, terms, _estimate(terms, subs, model, kind, "fuser"), note,
                                 deterministic=mode != "atomic_dq"))
    if dev.type == "cuda":
        terms = cost_terms(m, "inductor", False, "two_kernel" if b["need_stats"] else None)
        out.append(Candidate("inductor", {"impl": "inductor"}, terms, _estimate(terms, subs, model, kind, "inductor"),
                             "left to Inductor: S1, S2 and log-probabilities materialised"))
    return out


def plan_string(params: dict) -> str:
    """The ``plan`` argument of ``torch.ops.fuser.attention_kl``."""
    return f"split_k={params.get('split_k', '1')};backward={params.get('backward', 'two_kernel')}"


def kernels(m: Match, plan: Candidate) -> list:
    """The rendered kernels the plan runs."""
    from fuser.codegen import attention_kl

    if plan.params.get("impl") != "fuser":
        return []
    b = m.bindings
    ms = b["mask_shape"]
    row = ms is not None and (len(ms) < 2 or ms[-2] == 1)
    return attention_kl.kernels_for(
        causal=b["causal"], mask_kind=b["mask_kind"], mask_row_broadcast=bool(row),
        split_k=plan.params.get("split_k", "1") != "1", bwd_mode=plan.params.get("backward", "two_kernel"),
        interpret=b["device"].type == "cpu", training=b["need_stats"], teacher_grad=b["grad_teacher"],
        **attention_kl.fill_variant(b["causal"], b["mask_kind"], *_fills(b)),
        zero_hidden=bool(b.get("zero_hidden")),
    )


def _fills(b: dict) -> tuple:
    """(mask_fill1, mask_fill2, causal_fill1, causal_fill2, causal_fill_mode) of a match."""
    s1, s2 = b["s1"], b["s2"]
    return s1.mask_fill, s2.mask_fill, s1.causal_fill, s2.causal_fill, s1.causal_fill_mode


def emit(m: Match, plan: Candidate, graph: fx.Graph) -> fx.Node:
    """Insert the fused op and the user's reduction of its per-row KL before the match's root."""
    b = m.bindings
    s1, s2 = b["s1"], b["s2"]
    rank = b["rank"]
    e1 = Emitter(graph, rank, s1.compute_dtype)
    e2 = Emitter(graph, rank, s2.compute_dtype)
    with graph.inserting_before(m.insertion_point):
        q1 = e1.operand(s1.q, s1.q_p, s1.in_dtype, detach=not b["grad_teacher"], factors=s1.dynamic_factors)
        k1 = e1.operand(_k(s1), s1.k_p, s1.in_dtype, detach=not b["grad_teacher"])
        q2 = e2.operand(s2.q, s2.q_p, s2.in_dtype, detach=not b["grad_student"], factors=s2.dynamic_factors)
        k2 = e2.operand(_k(s2), s2.k_p, s2.in_dtype, detach=not b["grad_student"])
        mask = e1.mask(b["mask_terms"], b["mask_shape"])
        op = e1.node(
            "call_function", torch.ops.fuser.attention_kl.default,
            (q1, k1, q2, k2, mask, e1.scale(s1.factors), e2.scale(s2.factors), b["causal"], b["mask_kind"],
             b["need_stats"], plan_string(plan.params), *_fills(b), bool(b.get("zero_hidden"))),
        )
        rows = e1.unrank(e1.node("call_function", operator.getitem, (op, 0)))  # [*batch, Nq]
        red = b["reduction"]
        if red == "rows":
            out = e1.node("call_method", "unsqueeze", (rows, -1)) if b["keepdim"] else rows
        else:
            out = e1.node("call_method", "sum", (rows,))
            if red == "mean":  # kl_div's "mean" divides by every element, N_k included
                n_rows = e1.node("call_method", "numel", (rows,))
                n_k = e1.node("call_method", "size", (k1, 2))
                out = e1.node("call_function", operator.truediv, (out, e1.node("call_function", operator.mul, (n_rows, n_k))))
            elif red == "batchmean":  # divides by the size of the terms' dim 0 only
                out = e1.node("call_function", operator.truediv, (out, e1.node("call_method", "size", (q1, 4 - rank))))
        if b["out_dtype"] != torch.float32:
            out = e1.node("call_method", "to", (out, b["out_dtype"]))
    return out

