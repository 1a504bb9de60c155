"""The H2O pattern: column sums of attention probabilities, with or without ``P V``.

H2O (Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large
Language Models", NeurIPS 2023) and its relatives (kvpress' ObservedAttention, SnapKV) score the
keys of a KV cache by ``score_j = Σ_i P_ij``, the sum over the query axis of the row softmax
``P = softmax(scale · Q Kᵀ + mask)``, usually next to ``O = P V``. The softmax reduces rows and
the score reduces columns, so one row-parallel kernel cannot finish both; the plan here is two
kernels (``codegen/h2o.py``): the attention forward (O and the LSE), then a column-parallel
kernel that recomputes ``P`` from the LSE and sums it (``docs/math.md``).

What is matched (``view`` canonical ops): a softmax over the keys of scores that
:func:`patterns.scores.analyze_scores` accepts (the same Q Kᵀ, scale, mask, causal and GQA
spellings as attention), whose probabilities — through casts — are read by exactly one sum over
the query axis (``P.sum(-2)``, ``P.sum(2)`` on ``[B, H, Nq, Nk]``, ``torch.sum(P, 1)`` on
``[B·H, Nq, Nk]``) and at most one matmul
``P @ V``. The region's outputs are named: ``"score"`` (the sum) and, when present, ``"out"``.

Declined with a reason: P read by anything else; a sum over another axis (over the keys it is
1); gradients through the outputs (the op has no backward yet); finite fills and index
predicates (the column-sum kernel hides keys with ``-inf`` or adds a mask tensor); scores of
rank other than 3 (``[B·H, Nq, Nk]``, FlexGen/OPT) or 4; ``P V`` with a permuted v or output.
"""

from __future__ import annotations

import operator
from typing import Optional

import sympy
import torch
import torch.fx as fx

from fuser import costmodel as cm
from fuser.codegen import launch
from fuser.graph import GraphView, dtype, is_tensor, location, ndim, permuted, shape, val
from fuser.matcher import match
from fuser.names import user_name
from fuser.pattern import Candidate, Match, MatchContext, Pattern, Rejection
from fuser.static import symint_value

from . import h2o_ops  # noqa: F401  (registers torch.ops.fuser.h2o)
from .masks import FLOATS, Decline, describe_mask
from .scores import Emitter, analyze_scores, describe_scale, kv_heads, softmax_rule, within

SOFTMAX = softmax_rule()
THROUGH = frozenset({"cast", "identity"})
NEG_INF = float("-inf")


class H2OPattern(Pattern):
    """Attention probabilities summed over the query axis (H2O heavy-hitter scores)."""

    name = "h2o"
    plan_choices = {"impl": ("fuser", "inductor"), "plan": ("two_kernel", "one_kernel", "diag_cache", "autotune")}

    def anchors(self, view: GraphView):
        return [n for n in view.graph.nodes if view.op(n) == "softmax"]

    # -- match ---------------------------------------------------------------------------
    def match(self, anchor: fx.Node, ctx: MatchContext) -> Match | Rejection | None:
        view = ctx.view
        found = self._readers(anchor, view)
        if found is None:
            return None
        if isinstance(found, str):
            return Rejection(self.name, found, location(anchor), anchor.name)
        colsum, pv, passed = found
        first: Optional[Rejection] = None
        for b in match(SOFTMAX, anchor, view):
            try:
                return self._analyze(b, anchor, colsum, pv, passed, ctx)
            except Decline as exc:
                first = first or Rejection(self.name, str(exc), location(anchor), anchor.name)
        return first

    def _readers(self, p: fx.Node, view: GraphView):
        """``(sum node, P V node or None, nodes passed through)`` when P is read by one sum over
        the query axis and at most one matmul; None when no sum over the query axis reads P (not
        H2O); a reason string when P is also used elsewhere."""
        rank = ndim(p)
        passed = []
        # casts before P branches (a float32 softmax cast back to the input dtype)
        while len(view.readers(p)) == 1 and view.op(view.readers(p)[0]) in THROUGH:
            p = view.readers(p)[0]
            passed.append(p)
        ends = []
        for r in view.readers(p):
            x = r
            chain = []
            while view.op(x) in THROUGH and len(view.readers(x)) == 1:
                chain.append(x)
                x = view.readers(x)[0]
            ends.append((x, chain))
        sums = [(x, c) for x, c in ends if view.op(x) == "sum"]
        query_sums = [(x, c) for x, c in sums
                      if rank is not None and view.canon(x).attrs["dim"] == (rank - 2,)
                      and not view.canon(x).attrs["keepdim"]]
        if not query_sums:
            if sums and rank is not None and any(view.canon(x).attrs["dim"] == (rank - 1,) for x, _ in sums):
                return "P is summed over the keys (each row sums to 1), not over the queries"
            return None
        colsum, chain = query_sums[0]
        passed += chain
        others = [(x, c) for x, c in ends if x is not colsum]
        pv = None
        for x, c in others:
            cx = view.canon(x)
            if pv is None and cx is not None and cx.op == "matmul" and (c[-1] if c else p) is cx.args[0] \
                    and cx.attrs.get("pa") is None:
                pv = x
                passed += c
                continue
            return (f"the attention weights P ('{p.name}') are also read by '{x.name}' ({location(x)}); "
                    f"fusing the H2O scores would need P materialised")
        if len(query_sums) > 1:
            return f"P ('{p.name}') is summed over the queries more than once"
        return colsum, pv, passed

    def _analyze(self, b, anchor: fx.Node, colsum: fx.Node, pv: Optional[fx.Node], passed: list,
                 ctx: MatchContext) -> Match:
        view = ctx.view
        sm = view.canon(anchor)
        sc = analyze_scores(b, ctx)
        rank = sc.rank
        if rank not in (3, 4):
            raise Decline(f"scores of rank {rank}; the H2O kernels take [B, H, Nq, Nk] or [B·H, Nq, Nk] scores")
        if sm.attrs["dim"] != rank - 1:
            raise Decline(f"softmax over dim {sm.attrs['dim']}, not over the keys (last dim)")
        if sm.attrs["dtype"] not in (None, *FLOATS):
            raise Decline(f"softmax in {sm.attrs['dtype']}; fuser computes it in float32")
        for n in passed:
            c = view.canon(n)
            if c.op == "cast" and c.attrs["dtype"] not in FLOATS:
                raise Decline(f"P is cast to {c.attrs['dtype']}")
        if sc.pred is not None:
            raise Decline("masks from indices other than causal are not supported by the H2O kernels yet")
        if sc.mask_fill != NEG_INF or (sc.causal != "none" and sc.causal_fill != NEG_INF):
            raise Decline("finite mask fills are not supported by the H2O kernels yet (-inf only)")
        outputs = {"score": colsum} if pv is None else {"out": pv, "score": colsum}
        if ctx.grad_enabled and any(val(n).requires_grad for n in outputs.values()):
            raise Decline("the H2O outputs need gradients; the fused H2O op has no backward yet "
                          "(H2O scoring runs under torch.no_grad())")
        q, v = sc.q, None
        if pv is not None:
            pv_c = view.canon(pv)
            v = pv_c.args[1]
            if pv_c.attrs.get("pb") is not None or pv_c.attrs.get("po") is not None:
                raise Decline("P V with a permuted v or output (einsum layouts) is not supported by H2O yet")
            if not is_tensor(v) or ndim(v) != rank:
                raise Decline("v is not a tensor of the scores' rank")
            if dtype(v) != sc.in_dtype:
                raise Decline(f"q, k, v dtypes differ ({sc.in_dtype}, {dtype(v)})")
            if not within(shape(v)[-1], 1, 256):
                raise Decline(f"value head dim {shape(v)[-1]} is outside 1..256")
        k, v, group = kv_heads(sc, v, None, view)
        bindings = dict(q=q, k=k, v=v, q_p=sc.q_p, k_p=sc.k_p, factors=sc.factors, causal=sc.causal,
                        mask_terms=sc.mask_terms, mask_kind=sc.mask_kind, mask_shape=sc.mask_shape, group=group,
                        rank=rank, in_dtype=sc.in_dtype, compute_dtype=sc.compute_dtype, device=sc.device,
                        score_dtype=dtype(colsum), out_dtype=dtype(pv) if pv is not None else None)
        sq, sk = permuted(shape(q), sc.q_p), permuted(shape(k), sc.k_p)
        summary = {
            "q": user_name(q), "k": user_name(k), "v": user_name(v) if v is not None else "-",
            "scale": describe_scale(sc.factors), "causal": sc.causal, "mask": describe_mask(sc.mask_terms),
            "gqa_group": group, "dtype": str(sc.in_dtype).replace("torch.", ""),
            "shape": f"q{tuple(sq)} k{tuple(sk)}", "outputs": ", ".join(outputs),
        }
        if sc.buffers:
            summary["assumes_constant"] = sorted(set(sc.buffers))
        region = frozenset(b.region) | frozenset(passed) | set(outputs.values())
        inputs = tuple(sc.inputs) + ((v,) if v is not None else ())
        root = pv if pv is not None else colsum
        return Match(self.name, root, region, bindings, summary, location(anchor), ctx.graph_index,
                     inputs=inputs, outputs=outputs)

    # -- planning ------------------------------------------------------------------------
    def candidates(self, m: Match, ctx: MatchContext) -> list[Candidate]:
        from fuser.patterns.h2o_plans import candidates

        return candidates(m, ctx)

    def kernels(self, m: Match, plan: Candidate) -> list:
        from fuser.patterns.h2o_plans import kernels_for

        return kernels_for(m, plan)

    # -- emission --------------------------------------------------------------------------
    def emit(self, m: Match, plan: Candidate, graph: fx.Graph) -> dict:
        from fuser.patterns.h2o_plans import emit

        return emit(m, plan, graph)


# The plans' efficiencies (NOT MEASURED) and cost terms live in patterns/h2o_plans.py.
from .h2o_plans import EFFICIENCY  # noqa: E402,F401


def _int(x) -> int:
    return int(symint_value(x))


PATTERN = H2OPattern()
