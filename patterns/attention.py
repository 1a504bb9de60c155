"""Attention: ``O = softmax(scale · Q Kᵀ + mask) V``, fused FlashAttention-2 style.

Anchored on the softmax (``F.softmax``/``torch.softmax``/``Tensor.softmax`` with or without
``dtype=``, or written by hand as ``exp(s - amax(s)) / sum``), the pattern walks back through
the score transforms to ``Q Kᵀ`` and forward through casts and eval-mode dropout to ``P V``.
What it accepts, and why each rule is exact, is in the README's table of spellings; the
analysis below records a reason for every decline. The kernels are FlashAttention-2
(Dao, 2023, "FlashAttention-2: Faster Attention with Better Parallelism and Work
Partitioning", Alg. 1 and 2) in base 2; see ``codegen/attention.py``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.fx as fx

from fuser.codegen import predicate
from fuser.graph import GraphView, dtype, is_tensor, location, ndim, permuted, shape, val
from fuser.names import user_name
from fuser.matcher import Var, match
from fuser.pattern import Candidate, Match, MatchContext, Pattern, Rejection, match_device

from . import attention_ops  # noqa: F401  (registers torch.ops.fuser.attention and its backward)
from .attention_reference import CAUSAL_MODES, MASK_KINDS, causal_offset, reference  # noqa: F401
from .masks import FLOATS, Decline, describe_mask, rounds_below
from .scores import _same_dims, analyze_scores, analyze_sdpa, check_softmax, describe_scale, kv_heads, softmax_rule, within

# --------------------------------------------------------------------------------------------
# Spelling: rules as data (see fuser/matcher.py and patterns/scores.py)
# --------------------------------------------------------------------------------------------

SOFTMAX = softmax_rule()
# a softmax of anything (scores from another graph, for explain()'s graph-cut report)
SOFTMAX_OF_ANY = softmax_rule(scores=Var("S"))
# Between P and the P V matmul: casts, contiguous, dropout (checked: eval or p = 0).
P_THROUGH = frozenset({"cast", "identity", "dropout"})


def gradient_reaches(x: fx.Node, root: fx.Node, view: GraphView) -> bool:
    """Whether eager autograd takes a gradient from ``root`` back to ``x``: a chain of nodes from
    ``x`` to ``root`` each of which ran with gradients on, is not a ``detach`` and requires grad.
    (A view made under ``torch.no_grad()`` of a tensor that requires grad requires grad itself but
    passes no gradient: the grad mode each node ran under decides.) Nodes without a value count as
    passing one when gradients were on."""
    end = view.order[root]
    seen, stack = {x}, [x]
    while stack:
        for u in stack.pop().users:
            if u in seen or view.order.get(u, end + 1) > end:
                continue
            seen.add(u)
            if not view.grad_enabled.get(u, True) or view.op(u) == "detach":
                continue
            v = val(u)
            if isinstance(v, (tuple, list)):
                needs = any(isinstance(t, torch.Tensor) and t.requires_grad for t in v)
            else:
                needs = v.requires_grad if isinstance(v, torch.Tensor) else True
            if not needs:
                continue
            if u is root:
                return True
            stack.append(u)
    return False


def _check_gradient_cuts(sc, k: fx.Node, v: fx.Node, pv: fx.Node, detached: bool, view: GraphView,
                         ctx: MatchContext) -> None:
    """Decline when the fused op would give an input a gradient that eager does not: a
    ``torch.no_grad()`` block or ``.detach()`` between that input and the output cuts its gradient
    in the program (``q * c`` under no_grad folded into the scale, ``k.transpose`` or a GQA repeat
    under no_grad), while the op reads the input itself (``k`` and ``v``: as the op reads them,
    before a GQA repeat). A cut of every path from q and k (P or the scores without gradients) is
    exact: q and k are detached at emit (``detached``)."""
    if not (ctx.grad_enabled and view.grad_enabled.get(pv, True)):
        return  # the op runs without recording gradients, as the program's output does
    gets = [("v", v)] if detached else score_inputs(sc, k) + [("v", v)]
    decline_cut_inputs(gets, pv, view, "the attention output")


def score_inputs(sc, k: fx.Node) -> list:
    """``[(name, node)]`` of what the fused op reads for scores ``sc``: q, ``k`` (as the op reads
    it: before a GQA repeat) and the run-time scale factors."""
    return [("q", sc.q), ("k", k)] + [("the run-time scale factor", f) for f, _ in sc.dynamic_factors
                                      if isinstance(f, fx.Node)]


def decline_cut_inputs(named: list, out: fx.Node, view: GraphView, what: str, owner: str = "") -> None:
    """Raise :class:`Decline` for the first ``(name, node)`` of ``named`` that requires grad but
    whose gradient eager never takes from ``out`` (:func:`gradient_reaches`): the fused op reads
    that input and would give it one. ``what`` names ``out`` in the reason, ``owner`` prefixes the
    input's name (``"the student's "``)."""
    for name, x in named:
        vx = val(x)
        if isinstance(x, fx.Node) and isinstance(vx, torch.Tensor) and vx.requires_grad \
                and not gradient_reaches(x, out, view):
            raise Decline(f"{owner}{name} ('{x.name}') gets no gradient in the program (a torch.no_grad() block or "
                          f".detach() between it and {what}, {location(out)}), but the fused op "
                          "reads it and would give it one")


#: ``nn.MultiheadAttention``'s forward: Dynamo keeps it as one call (it does not trace into it).
MHA_FORWARD = torch.nn.functional.multi_head_attention_forward
MHA_OPAQUE = (
    "nn.MultiheadAttention reaches the graph as one call (F.multi_head_attention_forward: Dynamo does not "
    "trace into it), so its attention is not visible to fuser; Inductor runs it as PyTorch does (its SDPA "
    "kernels when need_weights=False). To have fuser fuse it, write the attention out: "
    "F.scaled_dot_product_attention, or softmax(q @ k.transpose(-2, -1) * scale) @ v"
)

#: Where a graph ends or begins inside an attention core (``fuser.cuts``): Dynamo compiled its
#: halves as separate graphs, and fuser sees one graph at a time.
GRAPH_CUT = (
    "fuser fuses softmax(q kᵀ) with P V only within one captured graph, and this graph {where} at {cut}. "
    "{case}; TORCH_LOGS=graph_breaks names a break's cause and fullgraph=True turns it into an error "
    "(under DDP, DDPOptimizer splits at gradient buckets: an nn.Parameter used inside the attention, e.g. a "
    "learned temperature or bias, can put a boundary there)"
)


def _softmax_input(sm: fx.Node, view: GraphView) -> Any:
    """``x`` of a softmax over the last dim, ``sm``: the ``softmax`` op's input, or that of one
    written by hand (:data:`SOFTMAX_OF_ANY`); None for another node (a ``div`` that is no
    softmax)."""
    b = next(iter(match(SOFTMAX_OF_ANY, sm, view)), None)
    if b is None:
        return None
    c = view.canon(sm)
    if c.op == "softmax" and c.attrs["dim"] != ndim(c.args[0]) - 1:
        return None
    return b["S"]


def _active_dropout(c) -> bool:
    """Whether canonical op ``c`` is a dropout that drops (training, p ≠ 0)."""
    return c is not None and c.op == "dropout" and c.attrs["training"] is not False and c.attrs["p"] != 0


def _scores_sized(v: Any, x: torch.Tensor) -> bool:
    """Whether tensor ``v`` has as many elements as the scores ``x`` and the same last dim (the
    key axis): ``x`` may be ``v`` reshaped (``[B, H, N, N]`` read as ``[B·H, N, N]``)."""
    # sizes may be symbolic (unbacked too): equal only where provably so
    return (isinstance(v, torch.Tensor) and v.dim() >= 1
            and _same_dims((v.shape[-1], v.numel()), (x.shape[-1], x.numel())))


def _scores_like(v: Any, x: torch.Tensor) -> bool:
    """Whether graph input ``v`` could hold the scores ``x`` is computed from: at least 3-D
    (batched q kᵀ) and :func:`_scores_sized`."""
    return isinstance(v, torch.Tensor) and v.dim() >= 3 and _scores_sized(v, x)


def _scores_from_outside(x: fx.Node, view: GraphView, depth: int = 8) -> Optional[fx.Node]:
    """The scores-like graph input (:func:`_scores_like`) that the softmax input ``x`` is
    computed from (the scores, computed in another graph), when no scores-sized matmul
    (:func:`_scores_sized`) lies between them (a mask's own outer product does not count); else
    None. Walks back at most ``depth`` ops."""
    frontier, seen, found = [x], set(), None
    for _ in range(depth):
        nxt = []
        for n in frontier:
            if n in seen:
                continue
            seen.add(n)
            if n.op == "placeholder":
                if found is None and _scores_like(val(n), val(x)):
                    found = n
                continue
            if view.op(n) in ("matmul", "sdpa") and _scores_sized(val(n), val(x)):
                return None  # the scores' matmul is in this graph (2-D q kᵀ too): no cut between
            nxt.extend(a for a in n.all_input_nodes if is_tensor(a))
        frontier = nxt
    return found if not frontier else None


class AttentionPattern(Pattern):
    """Scaled dot-product attention with optional causal/padding/bias masks and GQA."""

    name = "attention"
    # impl=sdpa and impl=inductor exist only for CUDA tensors; backward=autotune only under fuser.autotune
    plan_choices = {
        "impl": ("fuser", "sdpa", "inductor"),
        "backward": ("two_kernel", "atomic_dq", "autotune"),
    }

    def anchors(self, view: GraphView):
        for n in view.graph.nodes:
            op = view.op(n)
            if op in ("softmax", "div", "sdpa") or (n.op == "call_function" and n.target is MHA_FORWARD):
                yield n

    def why_not_offered(self, match: Match, choice: str, value: str) -> str:
        dev = match_device(match)
        if choice == "impl" and value == "sdpa":
            if dev is not None and dev.type == "cpu":
                return ("SDPA plans exist only on CUDA; these tensors are on the CPU, where fuser's kernels run in "
                        "Triton's interpreter. Drop attention.impl from fuser.plan, or leave CPU regions to "
                        "Inductor with fuser.interpret=False")
            from .attention_plans import sdpa_not_exact

            why = sdpa_not_exact(match)
            return ("SDPA is offered only where it computes exactly what the region does" + (f": {why}" if why else ""))
        if choice == "impl" and value == "inductor" and match.bindings.get("sdpa"):
            return ("the program calls scaled_dot_product_attention itself: fuser offers its own kernels or the call "
                    "as written (attention.impl=sdpa), not a decomposition for Inductor")
        if choice == "backward" and value == "autotune":
            return "backward=autotune is offered only under fuser.autotune=True (or mode=\"max-autotune\")"
        return ""

    # -- match ---------------------------------------------------------------------------
    def match(self, anchor: fx.Node, ctx: MatchContext) -> Match | Rejection | None:
        view = ctx.view
        if anchor.target is MHA_FORWARD:
            return Rejection(self.name, MHA_OPAQUE, location(anchor), anchor.name)
        if view.op(anchor) == "sdpa":
            try:
                return self._analyze_sdpa(anchor, ctx)
            except Decline as exc:
                return Rejection(self.name, str(exc), location(anchor), anchor.name)
        first_decline: Optional[Rejection] = None
        for b in match(SOFTMAX, anchor, view):
            consumer = self._consumer(anchor, view)
            if consumer is None:
                # a softmax that does not feed P V: not attention (maybe H2O, KL), unless P of
                # batched q kᵀ leaves the graph (a classifier's x @ W.t() has a 2-D W)
                cut = ctx.cuts.after if ctx.cuts is not None else None
                if cut and all(ndim(b[n]) >= 3 for n in ("q", "kT")) and self._leaves_graph(anchor, view):
                    why = (f"the attention weights P ('{anchor.name}') leave this graph as an output and meet no "
                           "P V matmul in it. "
                           + GRAPH_CUT.format(where="ends", cut=cut,
                                              case="If your code multiplies P by V next, that cut lies between "
                                                   "the two"))
                    return Rejection(self.name, why, location(anchor), anchor.name)
                return None
            if isinstance(consumer, str):
                return Rejection(self.name, consumer, location(anchor), anchor.name)
            pv, p_nodes = consumer
            try:
                return self._analyze(b, anchor, pv, p_nodes, ctx)
            except Decline as exc:
                first_decline = first_decline or Rejection(self.name, str(exc), location(anchor), anchor.name)
        cut = ctx.cuts.before if ctx.cuts is not None else None
        if first_decline is None and cut and view.op(anchor) in ("softmax", "div"):
            return self._cut_before_softmax(anchor, view, cut)
        return first_decline

    def _cut_before_softmax(self, sm: fx.Node, view: GraphView, cut: str) -> Optional[Rejection]:
        """``softmax(x) @ v`` where ``x`` is a graph input of a graph that begins at a cut
        (``cut``, :mod:`fuser.cuts`): the scores were computed in the graph before. A near-miss,
        so that explain() says why."""
        x = _softmax_input(sm, view)
        if not isinstance(x, fx.Node) or not is_tensor(x) or val(x).dim() < 3:
            return None  # a 2-D softmax (a classifier's logits) is no batched attention
        consumer = self._consumer(sm, view)
        if not isinstance(consumer, tuple):
            return None
        if any(_active_dropout(view.canon(n)) for n in consumer[1]):
            return None  # not fused in one graph either
        if ndim(view.canon(consumer[0]).args[1]) < 3:
            return None  # P times a 2-D matrix (an embedding table): a classifier, not P V
        inp = _scores_from_outside(x, view)
        if inp is None:
            return None
        why = (f"the softmax '{sm.name}' reads scores that come from outside this graph (its input "
               f"'{user_name(inp)}', with no q kᵀ matmul in between) and feeds the P V matmul '{consumer[0].name}'. "
               + GRAPH_CUT.format(where="begins", cut=cut,
                                  case="If your code computes these scores from q kᵀ, that cut lies between the two"))
        return Rejection(self.name, why, location(sm), sm.name)

    @staticmethod
    def _through_p(p: fx.Node, view: GraphView):
        """Follow P through casts/dropout (ops of ``P_THROUGH`` reading it as their first
        argument) while it has exactly one reader: (the last node reached, the nodes passed, the
        readers of the last node)."""
        passed, x = [], p
        while True:
            readers = view.readers(x)
            if len(readers) == 1:
                c = view.canon(readers[0])
                if c is not None and c.op in P_THROUGH and c.args[0] is x:
                    passed.append(readers[0])
                    x = readers[0]
                    continue
            return x, passed, readers

    @classmethod
    def _leaves_graph(cls, p: fx.Node, view: GraphView) -> bool:
        """Whether P, through casts/dropout, is only read by the graph's output (an active
        dropout on the way: no, it is not fused in one graph either)."""
        _, passed, readers = cls._through_p(p, view)
        active = any(_active_dropout(view.canon(n)) for n in passed)
        return len(readers) == 1 and readers[0].op == "output" and not active

    def _consumer(self, p: fx.Node, view: GraphView):
        """Follow P through casts/dropout to the P V matmul: (pv node, nodes passed), None if
        P feeds no matmul as its left operand, or a reason string if P is also used elsewhere."""
        x, passed, readers = self._through_p(p, view)
        if len(readers) != 1:
            if any(view.op(r) == "matmul" and view.canon(r).args[0] is x for r in readers):
                names = ", ".join(f"'{r.name}' ({location(r)})" for r in readers)
                return (
                    f"the attention weights P ('{x.name}') are also used outside the attention "
                    f"(readers: {names}); fusing would need P materialised"
                )
            return None
        r = readers[0]
        c = view.canon(r)
        if c is not None and c.op == "matmul" and c.args[0] is x and c.attrs.get("pa") is None:
            return r, passed
        return None

    def _analyze(self, b, anchor: fx.Node, pv: fx.Node, p_nodes: list, ctx: MatchContext) -> Match:
        view = ctx.view
        sm = view.canon(anchor)
        sc = analyze_scores(b, ctx, predicates=True)
        rank = sc.rank
        if sm.op == "softmax":
            check_softmax(sm, rank)
        for n in p_nodes:
            c = view.canon(n)
            if _active_dropout(c):
                raise Decline(f"dropout on the attention weights is active (p={c.attrs['p']}, training); not fused")
            if c.op == "cast" and c.attrs["dtype"] not in FLOATS:
                raise Decline(f"P is cast to {c.attrs['dtype']}")
            if c.op == "cast" and rounds_below(c.attrs["dtype"], sc.compute_dtype):
                raise Decline(f"P is rounded to {c.attrs['dtype']}, below the {sc.compute_dtype} the scores are "
                              "computed in; the fused kernels keep it in float32 up to P V")

        pv_c = view.canon(pv)
        # softmax(S.detach()) V, or P computed under torch.no_grad(): gradients reach v only
        # (q and k are detached at emit). Dynamo keeps no_grad blocks as grad-mode switches;
        # the values it recorded tell whether P carries a gradient.
        p_last = p_nodes[-1] if p_nodes else anchor
        detached = sc.detached or (ctx.grad_enabled and not val(p_last).requires_grad and sc.requires_grad())
        region = frozenset(b.region) | frozenset(p_nodes) | {pv}
        return self._finish(sc, pv_c.args[1], pv_c.attrs.get("pb"), pv, region, detached, ctx,
                            "hand-written" if sm.op == "div" else "softmax", anchor, out_p=pv_c.attrs.get("po"))

    def _analyze_sdpa(self, node: fx.Node, ctx: MatchContext) -> Match:
        sc = analyze_sdpa(node, ctx, predicates=True)
        return self._finish(sc, ctx.view.canon(node).args[2], None, node, frozenset({node}), sc.detached, ctx,
                            "scaled_dot_product_attention", node)

    def _finish(self, sc, v, v_p: Optional[tuple], pv: fx.Node, region: frozenset, detached: bool,
                ctx: MatchContext, softmax: str, anchor: fx.Node, out_p: Optional[tuple] = None) -> Match:
        """The match for scores ``sc`` feeding ``P V`` at ``pv``: the kernels take
        ``v.permute(v_p)`` as ``[..., Nk, Dv]`` and the result is ``out.permute(out_p)``
        (an ``einsum`` writing ``[B, N, H, D]``)."""
        view = ctx.view
        rank = sc.rank
        if not is_tensor(v):
            raise Decline("v is not a tensor")
        if ndim(v) != rank:
            raise Decline(f"v has rank {ndim(v)}, the scores {rank} (broadcast matmul)")
        q = sc.q
        k, v, group = kv_heads(sc, v, v_p, view)
        if dtype(v) != sc.in_dtype:
            raise Decline(f"q, k, v dtypes differ ({sc.in_dtype}, {sc.in_dtype}, {dtype(v)})")
        if dtype(pv) in FLOATS and rounds_below(sc.compute_dtype, dtype(pv)):
            # e.g. the scores under torch.autocast and P V after it: the kernels would compute P V
            # (v included) in the scores' dtype, rounding what the program keeps wider
            raise Decline(f"P V is computed in {dtype(pv)}, wider than the {sc.compute_dtype} the scores are "
                          "computed in (an autocast region ending between them?); the kernels compute both in one dtype")
        sq, sk, sv = permuted(shape(q), sc.q_p), permuted(shape(k), sc.k_p), permuted(shape(v), v_p)
        dv = sv[-1]
        if not within(dv, 1, 256):
            raise Decline(f"value head dim {dv} is outside 1..256")
        if group == 1 and not _same_dims(tuple(permuted(shape(sc.k), sc.k_p)[:-2]), tuple(sv[:-2])):
            raise Decline("k and v batch dims differ (broadcasting batched matmul)")
        _check_gradient_cuts(sc, k, v, pv, detached, view, ctx)
        need_lse = bool(ctx.grad_enabled and val(pv).requires_grad
                        and (val(v).requires_grad or (not detached and sc.requires_grad())))
        bindings = dict(
            q=q, k=k, v=v, q_p=sc.q_p, k_p=sc.k_p, v_p=v_p, out_p=out_p, factors=sc.factors, causal=sc.causal,
            causal_fill=sc.causal_fill, causal_fill_mode=sc.causal_fill_mode, mask_fill=sc.mask_fill,
            mask_terms=sc.mask_terms, mask_kind=sc.mask_kind, mask_shape=sc.mask_shape, group=group, rank=rank,
            in_dtype=sc.in_dtype, compute_dtype=sc.compute_dtype, out_dtype=dtype(pv), need_lse=need_lse,
            device=sc.device, detach_qk=detached, sdpa=softmax == "scaled_dot_product_attention",
            pred=sc.pred, pred_consts=sc.pred_consts, pred_fill=sc.pred_fill, pred_fill_mode=sc.pred_fill_mode,
            size_sources=sc.size_sources,
        )
        summary = {
            "q": user_name(q), "k": user_name(k), "v": user_name(v),
            "scale": describe_scale(sc.factors),
            "causal": sc.causal,
            "mask": describe_mask(sc.mask_terms),
            "gqa_group": group,
            "dtype": str(sc.in_dtype).replace("torch.", ""),
            "shape": f"q{tuple(sq)} k{tuple(sk)} v{tuple(sv)}",
            "softmax": softmax,
            "training": need_lse,
        }
        if sc.causal != "none" and sc.causal_fill != float("-inf"):
            summary["causal_fill"] = f"{sc.causal_fill:g} ({sc.causal_fill_mode})"
        if sc.mask_fill != float("-inf"):
            summary["mask_fill"] = f"{sc.mask_fill:g}"
        if sc.pred is not None:
            words = predicate.describe(sc.pred, consts=tuple(str(c) for c in sc.pred_consts)).replace(" + 0", "")
            summary["keep"] = words + ("" if sc.pred_fill == float("-inf")
                                       else f" (others {sc.pred_fill:g}, {sc.pred_fill_mode})")
        if sc.buffers:
            summary["assumes_constant"] = sorted(set(sc.buffers))
        inputs = tuple(sc.inputs) + (v,)
        return Match(self.name, pv, region, bindings, summary, location(anchor), ctx.graph_index, inputs=inputs)

    # -- planning ------------------------------------------------------------------------
    def candidates(self, m: Match, ctx: MatchContext) -> list[Candidate]:
        from fuser.patterns.attention_plans import candidates

        return candidates(m, ctx)

    def kernels(self, m: Match, plan: Candidate) -> list:
        from fuser.codegen import attention as kernels

        if plan.params.get("impl") != "fuser":
            return []
        from fuser.patterns.attention_plans import mask_row_broadcast

        b = m.bindings
        row_bcast = mask_row_broadcast(b)
        mode = plan.params.get("backward", "two_kernel")
        out = []
        for bwd_mode in (("two_kernel", "atomic_dq") if mode == "autotune" else (mode,)):
            for k in kernels.kernels_for(
                causal=b["causal"], mask_kind=b["mask_kind"], mask_row_broadcast=bool(row_bcast),
                bwd_mode=bwd_mode, interpret=b["device"].type == "cpu",
                need_lse=b["need_lse"], training=b["need_lse"], mask_fill=b["mask_fill"],
                causal_fill=b["causal_fill"], causal_fill_mode=b["causal_fill_mode"], mask_pred=b["pred"],
                pred_fill=b["pred_fill"], pred_fill_mode=b["pred_fill_mode"],
            ):
                if k not in out:
                    out.append(k)
        return out

    # -- emission --------------------------------------------------------------------------
    def emit(self, m: Match, plan: Candidate, graph: fx.Graph) -> fx.Node:
        from fuser.patterns.attention_plans import emit

        return emit(m, plan, graph)


PATTERN = AttentionPattern()
