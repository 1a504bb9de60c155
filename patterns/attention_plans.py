"""Plans for an attention match — their symbolic costs — and the graph code each emits.

Candidates:

``fuser[backward=two_kernel]``
    FlashAttention-2 forward; backward as a dK/dV kernel and a dQ kernel, each recomputing
    P (deterministic). Per visible (query, key) pair: forward ``2(D + Dv)`` FLOPs, backward
    ``8D + 6Dv`` FLOPs (``14·d`` for ``D = Dv = d``).
``fuser[backward=atomic_dq]``
    the same forward; one backward kernel that also accumulates dQ with fp32 atomics:
    ``6D + 4Dv`` FLOPs per pair (``10·d``), plus ``Nk / BLOCK_N`` atomic updates of each dQ row.
``fuser`` (inference)
    forward only, no LSE stored.
``sdpa``
    ``F.scaled_dot_product_attention`` (FlashAttention on the GPU) — offered on CUDA when
    SDPA takes the case exactly: no mask tensor, causal top-left (or bottom-right with
    Nq = Nk), D = Dv, fp16/bf16.
``inductor``
    leave the region to Inductor: scores and P materialised in HBM.
``sdpa (as written)``
    for a matched ``F.scaled_dot_product_attention`` call: keep the program's own call
    (FlashAttention without a mask tensor, the memory-efficient kernel with one).
"""

from __future__ import annotations

import operator
from typing import Optional

import sympy
import torch
import torch.fx as fx
import torch.nn.functional as F

from fuser import costmodel as cm
from fuser.codegen import launch, predicate
from fuser.graph import permuted, shape, val
from fuser.pattern import Candidate, Match, MatchContext
from fuser.static import symint_value

from . import attention_ops  # noqa: F401  (registers torch.ops.fuser.attention)
from .masks import NEG_INF
from .scores import Emitter
from . import planning

BLOCK_M, BLOCK_N = 128, 64  # the nominal tile used for tile counts in the cost model


def _shape_subs(m: Match) -> dict:
    b = m.bindings
    sq, sk, sv = shape(b["q"]), shape(b["k"]), shape(b["v"])

    def dims(s, perm):
        s = [symint_value(x) for x in permuted(s, perm)]
        return [1] * (4 - len(s)) + list(s)

    q4, k4, v4 = dims(sq, b["q_p"]), dims(sk, b["k_p"]), dims(sv, b["v_p"])
    return {
        cm.B: q4[0], cm.H: q4[1], cm.HKV: k4[1], cm.NQ: q4[2], cm.NK: k4[2], cm.D: q4[3], cm.DV: v4[3],
    }


def mask_row_broadcast(b: dict) -> bool:
    """Whether the match's data mask is one row broadcast over the queries (key padding)."""
    ms = b["mask_shape"]
    return ms is not None and (len(ms) < 2 or ms[-2] == 1)


def skips_on_mask(b: dict) -> bool:
    """Whether fuser's kernels test the match's data mask at run time for key tiles it hides
    above the diagonal (``codegen/attention.py`` ``mask_skips``, ``mask_tiles_skippable``)."""
    from fuser.codegen import attention as kernels

    return bool(b["mask_terms"]) and kernels.mask_skips(b["causal"], b["mask_kind"], mask_row_broadcast(b),
                                                         kernels.as_predicate(b["pred"]))


def cost_terms(m: Match, impl: str, backward: str | None) -> dict:
    """Symbolic cost terms of one candidate (see the module docstring)."""
    b = m.bindings
    elt = b["in_dtype"].itemsize
    causal = b["causal"]
    if causal == "none" or b["causal_fill"] != NEG_INF:  # a finite fill visits every key
        pairs = cm.NQ * cm.NK
    else:
        off = 0 if causal == "top_left" else cm.NK - cm.NQ
        pairs = cm.pairs_causal(cm.NQ, cm.NK, off)
    bh = cm.B * cm.H
    io = elt * (bh * cm.NQ * (cm.D + 2 * cm.DV) + cm.B * cm.HKV * cm.NK * (cm.D + cm.DV))
    mask_bytes = 0
    for t in b["mask_terms"]:
        mv = val(t["node"])
        mask_bytes += int(symint_value(mv.numel())) * mv.element_size()
    if impl == "inductor":
        # scores and P written and read back (fp32 softmax), backward reads/writes them again
        score_bytes = bh * cm.NQ * cm.NK * (2 * elt + 2 * 4)
        terms = {
            "flops": 2 * bh * cm.NQ * cm.NK * (cm.D + cm.DV),
            "bytes": io + score_bytes + mask_bytes,
            "exps": bh * cm.NQ * cm.NK,
            "launches": 4,
        }
        if backward:
            terms["flops"] = terms["flops"] * 3
            terms["bytes"] = terms["bytes"] + 2 * score_bytes + io
            terms["launches"] = 10
        return terms
    # the run-time test of a data mask for tiles it hides above the diagonal reads the mask once
    # more, forward and backward; the estimate keeps every tile (whether they are skipped is
    # known only at run time)
    if impl == "fuser" and skips_on_mask(b):
        mask_bytes = 2 * mask_bytes
    terms = {
        "flops": 2 * bh * pairs * (cm.D + cm.DV),
        "bytes": io + 4 * bh * cm.NQ + mask_bytes,
        "exps": bh * pairs,
        "tiles": sympy.ceiling(cm.NQ / BLOCK_M) * bh,
        "launches": 1,
    }
    if backward == "two_kernel":
        terms["bwd_flops"] = bh * pairs * (8 * cm.D + 6 * cm.DV)
        terms["bwd_exps"] = 2 * bh * pairs
    elif backward in ("atomic_dq", "autotune"):
        terms["bwd_flops"] = bh * pairs * (6 * cm.D + 4 * cm.DV)
        terms["bwd_exps"] = bh * pairs
        terms["atomics"] = bh * cm.NQ * cm.D * sympy.ceiling(cm.NK / BLOCK_N)
    if backward:
        terms["bwd_bytes"] = 2 * io + 8 * bh * cm.NQ + mask_bytes
        terms["bwd_tiles"] = sympy.ceiling(cm.NK / BLOCK_N) * cm.B * cm.HKV
    return terms


# Fraction of the bf16 matrix-unit peak (790 TFLOP/s) each implementation reaches on long
# sequences, by head-dim bucket (<=64, <=128, <=256): (forward, backward). Measured on the H100
# (torch 2.11, Triton 3.6, B=4, H=16, N=4096, bf16; 2026-11-21): fuser forward 416/501/302
# TFLOP/s, backward 280/329/129-156; SDPA forward 469/661/587, backward 435/531/360.
# Re-measure after kernel changes (benchmarks/attention.py).
EFFICIENCY = {
    "fuser": ((0.50, 0.60, 0.38), (0.35, 0.42, 0.18)),
    "sdpa": ((0.56, 0.78, 0.74), (0.52, 0.62, 0.45)),
    # NOT MEASURED (estimates): SDPA with a mask tensor runs the memory-efficient kernel, not
    # FlashAttention. Taken below fuser's own kernels because issue 7 measured an HF Llama
    # training step with padding masks 1.31x faster through fuser than through SDPA; replace
    # with benchmarks/attention.py measurements of SDPA with attn_mask on the H100.
    "sdpa_efficient": ((0.30, 0.35, 0.20), (0.22, 0.26, 0.12)),
}


def _estimate(terms: dict, subs: dict, model: cm.DeviceModel, kind: str, impl: str) -> float:
    d = max(subs[cm.D], subs[cm.DV])
    if impl == "inductor":
        return cm.estimate_ms(terms, subs, model, kind, cm.efficiency(cm.EAGER_MATMUL, d))
    fwd_table, bwd_table = EFFICIENCY[impl]
    eff_f, eff_b = cm.efficiency(fwd_table, d), cm.efficiency(bwd_table, d)
    fwd = {k: terms[k] for k in ("flops", "bytes", "exps", "tiles", "launches") if k in terms}
    t = cm.estimate_ms(fwd, subs, model, kind, eff_f)
    if "bwd_flops" in terms:
        bwd = {
            "flops": terms["bwd_flops"], "bytes": terms["bwd_bytes"], "exps": terms["bwd_exps"],
            "tiles": terms["bwd_tiles"], "launches": 2 if "atomics" not in terms else 3,
        }
        t += cm.estimate_ms(bwd, subs, model, kind, eff_b)
        t += cm.atomics_ms(terms, subs, model)
    return t


def candidates(m: Match, ctx: MatchContext) -> list[Candidate]:
    """Every plan this match can run with, each with its estimate at the example shapes."""
    b = m.bindings
    dev = b["device"]
    interp = dev.type == "cpu"
    model = planning.device_model(dev, ctx)
    subs = _shape_subs(m)
    kind = cm.operand_kind(str(b["in_dtype"]), launch.dot_precision(b["in_dtype"]) == "tf32")
    training = b["need_lse"]
    tune = "1" if ctx.options.autotune else "0"
    tiles = _tiles(m, subs, training, tune == "1")
    out: list[Candidate] = []
    modes = ("two_kernel", "atomic_dq") if training else (None,)
    for mode in modes:
        terms = cost_terms(m, "fuser", mode)
        params = {"impl": "fuser", "autotune": tune}
        name = "fuser"
        if mode:
            params["backward"] = mode
            name = f"fuser[backward={mode}]"
        skip = ("; key tiles the mask hides above the diagonal skipped, and the mask not read on the tiles below "
                "it, where a run-time test of its values proves they add 0 / change nothing (estimate: every tile)"
                ) if skips_on_mask(b) else ""
        out.append(Candidate(name, params, terms, _estimate(terms, subs, model, kind, "fuser"),
                             "FlashAttention-2 kernels" + ("" if not mode else f", {mode} backward") + f"; {tiles}"
                             + skip, deterministic=mode != "atomic_dq"))
    if training and ctx.options.autotune:
        best = min(c.estimate_ms for c in out)
        terms = cost_terms(m, "fuser", "autotune")
        out.append(Candidate("fuser[backward=autotune]", {"impl": "fuser", "autotune": "1", "backward": "autotune"},
                             terms, best * 0.999, "backward mode and tiles timed on the device on first use"))
    if not interp and b.get("sdpa"):
        # the user's own scaled_dot_product_attention call, left as written
        flash = _sdpa_exact(m)
        terms = cost_terms(m, "sdpa", "two_kernel" if training else None)
        impl = "sdpa" if flash else "sdpa_efficient"
        out.append(Candidate("sdpa (as written)", {"impl": "sdpa", "keep": True}, terms,
                             _estimate(terms, subs, model, kind, impl),
                             "the program's own scaled_dot_product_attention ("
                             + ("FlashAttention" if flash else "memory-efficient kernel: a mask tensor") + ")"))
    elif not interp:
        if _sdpa_exact(m):
            terms = cost_terms(m, "sdpa", "two_kernel" if training else None)
            out.append(Candidate("sdpa", {"impl": "sdpa"}, terms, _estimate(terms, subs, model, kind, "sdpa"),
                                 "torch.nn.functional.scaled_dot_product_attention (FlashAttention)"))
        terms = cost_terms(m, "inductor", "two_kernel" if training else None)
        out.append(Candidate("inductor", {"impl": "inductor"}, terms, _estimate(terms, subs, model, kind, "inductor"),
                             "left to Inductor: scores and P materialised"))
    return out


def _tiles(m: Match, subs: dict, training: bool, tuned: bool) -> str:
    """The tile configs the kernels will use here (from the config table), for reports."""
    if tuned:
        return "tiles timed on first use (autotune)"
    from fuser.codegen import attention as kernels

    b = m.bindings
    kw = dict(head_dim=subs[cm.D], head_dim_v=subs[cm.DV], dtype=b["in_dtype"], device=b["device"], causal=b["causal"])
    f = kernels.candidate_configs(kind="fwd", n_ctx=kernels.context_length(subs[cm.NQ], subs[cm.NK]), **kw)[0]
    text = f"fwd {f['BLOCK_M']}x{f['BLOCK_N']} w{f['num_warps']} s{f['num_stages']}"
    if training:
        g = kernels.candidate_configs(kind="bwd", **kw)[0]
        text += (f", bwd dkdv {g['BLOCK_M1']}x{g['BLOCK_N1']} dq {g['BLOCK_M2']}x{g['BLOCK_N2']}"
                 f" w{g['num_warps']} s{g['num_stages']}")
    return text


def _sdpa_exact(m: Match) -> bool:
    return sdpa_not_exact(m) is None


def sdpa_not_exact(m: Match) -> Optional[str]:
    """Why PyTorch's SDPA would not compute exactly what the region computes (so ``impl=sdpa``
    is not offered), or None when it would."""
    b = m.bindings
    if b["mask_terms"]:
        return "the region has a mask tensor (SDPA is offered only without one)"
    if b["in_dtype"] not in (torch.float16, torch.bfloat16):
        return f"the inputs are {str(b['in_dtype']).replace('torch.', '')} (SDPA is offered for float16/bfloat16)"
    if b["causal"] != "none" and b["causal_fill"] != NEG_INF:
        return "the causal fill is a finite value (SDPA's is_causal hides the keys)"
    if b["pred"] is not None:
        return "the mask is an index predicate SDPA has no flag for"
    subs = _shape_subs(m)
    d, dv = subs[cm.D], subs[cm.DV]
    if d != dv or d % 8 or d > 256:
        return f"the head dims are D={d}, Dv={dv} (SDPA is offered for D = Dv, a multiple of 8, at most 256)"
    if b["causal"] == "bottom_right":
        # SDPA's is_causal is top-left: the same only while Nq == Nk, so only for static sizes
        n_q = permuted(shape(b["q"]), b["q_p"])[-2]
        n_k = permuted(shape(b["k"]), b["k_p"])[-2]
        if not (isinstance(n_q, int) and isinstance(n_k, int) and n_q == n_k):
            return ("the causal mask is bottom-right with Nq ≠ Nk or sizes that may change (SDPA's is_causal is "
                    "top-left)")
    return None


def plan_string(params: dict) -> str:
    """The ``plan`` argument of ``torch.ops.fuser.attention`` for a candidate's params."""
    parts = [f"backward={params.get('backward', 'two_kernel')}", f"autotune={params.get('autotune', '0')}"]
    return ";".join(parts)


def emit(m: Match, plan: Candidate, graph: fx.Graph) -> fx.Node:
    """Insert the plan's replacement for ``m`` before its root; return the new output node."""
    b = m.bindings
    rank = b["rank"]
    compute = b["compute_dtype"]
    e = Emitter(graph, rank, compute)
    with graph.inserting_before(m.insertion_point):
        dyn = [(v, p) for v, p in b["factors"] if not isinstance(v, float)]
        q = e.operand(b["q"], b["q_p"], b["in_dtype"], detach=b["detach_qk"], factors=dyn)
        k = e.operand(b["k"], b["k_p"], b["in_dtype"], detach=b["detach_qk"])
        v = e.operand(b["v"], b["v_p"], b["in_dtype"])
        scale = e.scale(b["factors"])
        mask = e.mask(b["mask_terms"], b["mask_shape"])
        impl = plan.params["impl"]
        pred_text = predicate.serialize(b["pred"]) if b["pred"] is not None else ""
        if impl == "fuser":
            op = e.node(
                "call_function", torch.ops.fuser.attention.default,
                (q, k, v, mask, scale, b["causal"], b["mask_kind"], b["need_lse"], plan_string(plan.params),
                 b["mask_fill"], b["causal_fill"], b["causal_fill_mode"], pred_text,
                 [e.size_expr(c, b["size_sources"]) for c in b["pred_consts"]], b["pred_fill"], b["pred_fill_mode"]),
            )
            out = e.node("call_function", operator.getitem, (op, 0))
        elif impl == "sdpa":
            out = e.node(
                "call_function", F.scaled_dot_product_attention, (q, k, v),
                {"is_causal": b["causal"] != "none", "scale": scale, "enable_gqa": b["group"] > 1},
            )
        else:
            raise ValueError(f"attention plan {plan.name} emits nothing")
        out = e.unrank(out)
        if b.get("out_p") is not None:  # an einsum that writes [B, N, H, D]
            out = e.node("call_method", "permute", (out, *b["out_p"]))
        if b["out_dtype"] != compute:
            out = e.node("call_method", "to", (out, b["out_dtype"]))
    return out

