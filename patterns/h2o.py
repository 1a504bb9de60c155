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
spellings as attention), whose probabilities — through casts and eval-mode dropout — are read by
at most one matmul ``P @ V`` and by one score (:class:`ScorePath`): a chain of sums and means
whose reduced axes include the queries and not the keys (``P.sum(-2)``, ``P.sum(0).sum(1)``,
``P.sum((1, 2))``, ``P.mean(-2)``, keepdim; ``torch.sum(P, 1)`` on ``[B·H, Nq, Nk]``), with
basic slices anywhere before the sum over the queries. The fused op computes the per-(b, h)
column sums; the rest of the chain is replayed on them (:func:`score_output`), slices of the
query axis (SnapKV's window ``P[..., -w:, :]``) are applied to q and to the mask's rows
(:func:`window_rows`: the softmax is row-wise), with the causal alignment of the window's rows
worked out by :func:`window_causal`, and ``P V`` over every row then comes from the attention
op (:func:`window_out`). The region's outputs are named: ``"score"`` (the chain's last
reduction) and, when present, ``"out"``.

Declined with a reason: P read by anything else; a sum over the keys (each row sums to 1); a
sum over the queries of something computed from P; active dropout; gradients through the
outputs (the op has no backward yet); index predicates other than causal; a query window under a
finite causal fill (its rows would need the fill realigned); a window of a causal mask that
neither kernel alignment expresses; scores of rank other than 3 (``[B·H, Nq, Nk]``, FlexGen/OPT) or 4;
``P V`` with a permuted v or output.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Optional

import torch
import torch.fx as fx

from fuser.graph import GraphView, dtype, is_tensor, location, ndim, permuted, shape, val
from fuser.matcher import match
from fuser.names import user_name
from fuser.pattern import Candidate, Match, MatchContext, Pattern, Rejection
from fuser.static import symint_value

from . import h2o_ops  # registers torch.ops.fuser.h2o; plan_string
from .masks import FLOATS, Decline, describe_mask, rounds_below
from .scores import Emitter, _same_dims, analyze_scores, check_softmax, describe_scale, kv_heads, softmax_rule, within

SOFTMAX = softmax_rule()
THROUGH = frozenset({"cast", "identity"})
NEG_INF = float("-inf")
REDUCTIONS = ("sum", "mean")


@dataclasses.dataclass
class ScorePath:
    """How the score is read off P (``[..., Nq, Nk]``, of rank ``rank``): the nodes from P's
    reader to the score, as the region takes them.

    Attributes:
        nodes: casts, inactive dropout, slices and reductions, in order; the last is the score
            (``end``).
        steps: what :func:`score_output` replays on the op's column sums (with the query axis
            put back as a unit dim), as written: ``(op, dims, keepdim, over_queries)`` with
            ``op`` ``"sum"`` or ``"mean"``, ``dims`` the dims of the tensor it reads
            (non-negative), ``over_queries`` whether the query axis is among them; or
            ``("slice", index, axes)``: a basic slice of P's other axes (``[..., :-w]``: keys
            before the window), ``index`` with the query axis left whole, ``axes`` the P axes it
            slices. Slices of other axes commute with the sum over the queries.
        windows: slices of the query axis between P and the reduction over it (SnapKV's
            observation window ``P[..., -w:, :]``), in order: the op reads ``q`` sliced the same
            way (the softmax is row-wise, so the rows of P are the softmax of those rows).
        reduced: the axes of P reduced (always the query axis, never the key axis).
    """

    nodes: list
    steps: list
    windows: list
    reduced: frozenset

    @property
    def end(self) -> fx.Node:
        return self.nodes[-1]

    def describe(self, rank: int) -> str:
        """The reductions in words, e.g. ``"sum over batch, then sum over queries"``."""
        names = AXES[rank]
        axes, out, keep = list(range(rank)), [], False
        for op, dims, keepdim, *_ in (st for st in self.steps if st[0] != "slice"):
            out.append(f"{op} over {', '.join(names[axes[d]] for d in dims)}")
            keep = keep or keepdim
            if not keepdim:
                axes = [a for i, a in enumerate(axes) if i not in dims]
        return ", then ".join(out) + (" (keepdim)" if keep else "")

    def describe_slices(self, rank: int) -> str:
        """The slices in words, e.g. ``"queries[-w:], keys[:-w]"``; empty when there are none."""
        names = AXES[rank]
        out = [f"queries[{_slice_text(s)}]" for s in self.windows]
        for st in self.steps:
            if st[0] == "slice":
                out += [f"{names[a]}[{_slice_text(s)}]" for a, s in st[2]]
        return ", ".join(out)


AXES = {4: ("batch", "heads", "queries", "keys"), 3: ("batch·heads", "queries", "keys")}


def _through(x: fx.Node, prev: fx.Node, view: GraphView) -> bool:
    """``x`` passes ``prev``'s values on unchanged but for dtype: a cast, ``contiguous``/``clone``,
    or dropout (whether it is active is checked by :func:`_active_dropout`)."""
    c = view.canon(x)
    return c is not None and c.op in THROUGH | {"dropout"} and c.args[0] is prev


def _active_dropout(x: fx.Node, view: GraphView) -> Optional[str]:
    """The reason to decline when ``x`` is a dropout that may drop something (training and
    ``p != 0``, or either unknown at compile time); else None."""
    c = view.canon(x)
    if c is None or c.op != "dropout":
        return None
    p, training = c.attrs["p"], c.attrs["training"]
    if training is False or (isinstance(p, (int, float)) and p == 0):
        return None
    return (f"dropout on the attention weights is active ('{x.name}', {location(x)}: p={p}, training={training}); "
            "the fused H2O op does not drop out (H2O scores keys in eval mode)")


def _slices(x: fx.Node, prev: fx.Node, rank: int) -> Optional[tuple]:
    """``idx``, one slice per dim of ``prev`` (of rank ``rank``), when ``x`` is ``prev[idx]``
    with basic slices only (``P[..., -w:, :]``, ``P[:, :, -w:]``, ``P[..., -w:, :-w]``); else
    None (ints, new dims, tensor indices)."""
    if not (x.op == "call_function" and x.target is operator.getitem and x.args[0] is prev):
        return None
    idx = x.args[1] if isinstance(x.args[1], tuple) else (x.args[1],)
    if sum(i is Ellipsis for i in idx) > 1 or not all(i is Ellipsis or isinstance(i, slice) for i in idx):
        return None
    if Ellipsis in idx:
        at = idx.index(Ellipsis)
        idx = idx[:at] + (slice(None),) * (rank - len(idx) + 1) + idx[at + 1:]
    idx = idx + (slice(None),) * (rank - len(idx))
    return idx if len(idx) == rank else None


def _score_path(first: fx.Node, p: fx.Node, rank: int, view: GraphView):
    """The :class:`ScorePath` that starts at ``first``, a reader of P: casts, dropout, query
    windows, and sums or means, as long as each node has one reader and the key axis is not
    reduced; it ends at the last reduction. None when it never reduces the query axis; a reason
    string when it reduces the key axis first (each row of P sums to 1)."""
    query, key = rank - 2, rank - 1
    axes, reduced, nodes, steps, windows = list(range(rank)), set(), [], [], []
    end = end_steps = 0  # how many nodes and steps the path keeps: up to its last reduction
    prev, x = p, first
    while True:
        c = view.canon(x)
        idx = _slices(x, prev, len(axes))
        if c is not None and c.op in REDUCTIONS and c.args[0] is prev:
            # dim=None and dim=() both reduce every dim, as in torch
            dims = tuple(c.attrs["dim"] or range(len(axes)))
            over = {axes[d] for d in dims}
            if key in over:
                if query in reduced:
                    break  # a reduction of the score itself: it reads the region's output
                return (f"P ('{p.name}') is summed over the keys by '{x.name}' ({location(x)}); each row "
                        "sums to 1: not an H2O score (a sum over the queries is)")
            reduced |= over
            steps.append((c.op, dims, bool(c.attrs["keepdim"]), query in over))
            if not c.attrs["keepdim"]:
                axes = [a for i, a in enumerate(axes) if i not in dims]
            nodes.append(x)
            end, end_steps = len(nodes), len(steps)
        elif idx is not None:
            qdim = axes.index(query) if query in axes else None
            if qdim is not None and idx[qdim] != slice(None):
                if query in reduced:  # a keepdim sum over the queries, sliced: not worth the words
                    break
                windows.append(idx[qdim])
                idx = idx[:qdim] + (slice(None),) + idx[qdim + 1:]
            sliced = tuple((axes[d], s) for d, s in enumerate(idx) if s != slice(None))
            if sliced:
                steps.append(("slice", idx, sliced))
            nodes.append(x)
        elif _through(x, prev, view):
            nodes.append(x)
        else:
            break
        readers = view.readers(x)
        if len(readers) != 1:
            break
        prev, x = x, readers[0]
    if query not in reduced:
        return None
    return ScorePath(nodes[:end], steps[:end_steps], windows, frozenset(reduced))


def _not_p(p: fx.Node, rank: int, readers: list, view: GraphView) -> Optional[str]:
    """A reason when something computed from P (``P * w``, ``P.log()``), not P itself, is
    summed over the queries; else None (not H2O)."""
    for r in readers:
        if view.op(r) == "matmul" or shape(r) != shape(p):  # P V, or not elementwise
            continue
        for u in view.readers(r):
            c = view.canon(u)
            if c is not None and c.op in REDUCTIONS and c.args[0] is r and c.attrs["dim"] is not None \
                    and rank - 2 in c.attrs["dim"] and rank - 1 not in c.attrs["dim"]:
                return (f"'{u.name}' ({location(u)}) sums '{r.name}' over the queries, which is computed from "
                        f"the attention weights P ('{p.name}'), not P itself; the H2O kernels sum P")
    return None


def window_causal(windows: list, causal: str, nq, nk) -> str:
    """The causal alignment of P's rows after the query ``windows``, as the kernels take it on
    the sliced queries: rows ``[s, e)`` of a ``top_left`` mask see keys ``j <= i + s``; the
    kernels' ``top_left`` gives ``j <= i`` (so a prefix, ``s = 0``, keeps it) and ``bottom_right``
    ``j <= i + Nk - (e - s)`` (so a suffix, ``e = Nq``, gets it when ``Nq = Nk``). A
    ``bottom_right`` mask (``j <= i + s + Nk - Nq``) stays ``bottom_right`` on a suffix and
    becomes ``top_left`` on a prefix when ``Nq = Nk``. Raises Decline for the rest."""
    if causal == "none" or not windows:
        return causal
    if len(windows) > 1:
        raise Decline("several slices of the query axis under a causal mask; the H2O kernels take one window")
    s = windows[0]
    if s.step not in (None, 1):
        raise Decline(f"a strided window of queries ({_slice_text(s)}) under a causal mask has no causal alignment "
                      "the H2O kernels compute")
    square = _same_dims((nq,), (nk,))
    prefix = s.start is None or (isinstance(s.start, int) and s.start == 0)
    suffix = s.stop is None
    if prefix and suffix:
        return causal
    if suffix and (causal == "bottom_right" or square):
        return "bottom_right"
    if prefix and (causal == "top_left" or square):
        return "top_left"
    why = "Nq = Nk is not known" if (prefix or suffix) else "the window is neither a prefix nor a suffix of the rows"
    raise Decline(f"the window of queries [{_slice_text(s)}] under a {causal} causal mask has no causal alignment "
                  f"the H2O kernels compute ('top_left', 'bottom_right'): {why}")


def _slice_text(s: slice) -> str:
    """``s`` as written, with graph values by name: ``-w:``, ``neg:``, ``:8``, ``::2``."""
    def part(x):
        if isinstance(x, fx.Node):
            if x.op == "call_function" and x.target is operator.neg and isinstance(x.args[0], fx.Node):
                return "-" + user_name(x.args[0])
            return user_name(x)
        return "" if x is None else str(x)
    text = f"{part(s.start)}:{part(s.stop)}"
    return text + (f":{part(s.step)}" if s.step is not None else "")


class H2OPattern(Pattern):
    """Attention probabilities summed over the query axis (H2O heavy-hitter scores)."""

    name = "h2o"
    plan_choices = {"impl": ("fuser", "inductor"), "plan": ("two_kernel", "one_kernel", "diag_cache", "autotune")}

    def anchors(self, view: GraphView):
        # "div": a softmax written by hand, exp(S - max) / sum (the rule checks it is one)
        return [n for n in view.graph.nodes if view.op(n) in ("softmax", "div")]

    # -- match ---------------------------------------------------------------------------
    def match(self, anchor: fx.Node, ctx: MatchContext) -> Match | Rejection | None:
        view = ctx.view
        found = self._readers(anchor, view)
        if found is None:
            return None
        if isinstance(found, str):
            # a reason only where the softmax is over attention scores (not a classifier's)
            if next(iter(match(SOFTMAX, anchor, view)), None) is None:
                return None
            return Rejection(self.name, found, location(anchor), anchor.name)
        path, pv, passed = found
        first: Optional[Rejection] = None
        for b in match(SOFTMAX, anchor, view):
            try:
                return self._analyze(b, anchor, path, pv, passed, ctx)
            except Decline as exc:
                first = first or Rejection(self.name, str(exc), location(anchor), anchor.name)
        return first

    def _readers(self, p: fx.Node, view: GraphView):
        """``(score path, P V node or None, nodes passed through)`` when P is read by one
        reduction over the query axis (:class:`ScorePath`) and at most one matmul; None when no
        reduction over the query axis reads P (not H2O); a reason string when P is also used
        elsewhere, summed over the keys, or dropped out before the score or ``P V``."""
        rank = ndim(p)
        if rank is None:
            return None
        passed = []
        # casts before P branches (a float32 softmax cast back to the input dtype)
        while len(view.readers(p)) == 1 and _through(view.readers(p)[0], p, view):
            p = view.readers(p)[0]
            passed.append(p)
        paths, others = [], []
        for r in view.readers(p):
            path = _score_path(r, p, rank, view)
            if isinstance(path, ScorePath):
                paths.append(path)
            else:
                others.append((r, path))
        if not paths:
            reasons = [why for _, why in others if why]
            return reasons[0] if reasons else _not_p(p, rank, [r for r, _ in others], view)
        if len(paths) > 1:
            return f"P ('{p.name}') is summed over the queries more than once"
        path = paths[0]
        pv = None
        for r, _ in others:
            x, chain, prev = r, [], p
            while _through(x, prev, view) and len(view.readers(x)) == 1:
                chain.append(x)
                prev, x = x, view.readers(x)[0]
            cx = view.canon(x)
            if pv is None and cx is not None and cx.op == "matmul" and cx.args[0] is prev \
                    and cx.attrs.get("pa") is None:
                pv = x
                passed += chain
                continue
            return (f"the attention weights P ('{p.name}') are also read by '{x.name}' ({location(x)}); "
                    f"fusing the H2O scores would need P materialised")
        for n in passed + path.nodes:
            why = _active_dropout(n, view)
            if why:
                return why
        return path, pv, passed

    def _analyze(self, b, anchor: fx.Node, path: ScorePath, pv: Optional[fx.Node], passed: list,
                 ctx: MatchContext) -> Match:
        view = ctx.view
        sm = view.canon(anchor)
        sc = analyze_scores(b, ctx)
        rank = sc.rank
        if rank not in (3, 4):
            raise Decline(f"scores of rank {rank}; the H2O kernels take [B, H, Nq, Nk] or [B·H, Nq, Nk] scores")
        if sm.op == "softmax":  # a softmax by hand is over the last dim by its rule
            check_softmax(sm, rank)
        for n in passed + path.nodes:
            c = view.canon(n)
            if c is not None and c.op == "cast" and c.attrs["dtype"] not in FLOATS:
                raise Decline(f"P is cast to {c.attrs['dtype']}")
            # a rounding the program asks for before the score's own dtype (its last node) would be
            # dropped: the kernels keep P and the column sums in float32 up to that last cast
            if c is not None and c.op == "cast" and n is not path.end and rounds_below(c.attrs["dtype"], sc.compute_dtype):
                raise Decline(f"P is rounded to {c.attrs['dtype']} ('{n.name}'), below the {sc.compute_dtype} the "
                              "scores are computed in; the fused kernels keep it in float32 up to the score")
        colsum = path.end
        if dtype(colsum) not in FLOATS:
            raise Decline(f"the score '{colsum.name}' is {dtype(colsum)}; the fused op sums in float32 and casts "
                          "to float16, bfloat16 or float32")
        if sc.pred is not None:
            raise Decline("masks from indices other than causal are not supported by the H2O kernels yet")
        # finite fills are values, computed as eager computes them (codegen/h2o.py): a boolean
        # data mask's with every plan, a causal one (with or without a data mask) with two_kernel
        finite_causal = sc.causal != "none" and sc.causal_fill != NEG_INF
        # (a fill that is NaN or +inf as the scores hold it is declined by the mask analysis)
        finite_mask = sc.mask_kind in ("bool_keep", "bool_drop") and sc.mask_fill != NEG_INF
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
        nq, nk = shape(anchor)[-2:]
        score_causal = window_causal(path.windows, sc.causal, nq, nk)
        if finite_causal and path.windows:
            raise Decline("a query window of P under a causal mask with a finite fill is not supported by the "
                          "H2O kernels yet")
        bindings = dict(q=q, k=k, v=v, q_p=sc.q_p, k_p=sc.k_p, factors=sc.factors, causal=sc.causal,
                        mask_terms=sc.mask_terms, mask_kind=sc.mask_kind, mask_shape=sc.mask_shape, group=group,
                        rank=rank, in_dtype=sc.in_dtype, compute_dtype=sc.compute_dtype, device=sc.device,
                        score_dtype=dtype(colsum), out_dtype=dtype(pv) if pv is not None else None,
                        # the score's reading of P (issue 9 B): query windows, the rows' causal
                        # alignment after them, the reductions the op's column sums stand for
                        windows=tuple(path.windows), score_causal=score_causal, score_steps=tuple(path.steps),
                        # a finite causal fill (transformers' finfo.min causal mask): two_kernel only
                        causal_fill=sc.causal_fill if finite_causal else NEG_INF,
                        causal_fill_mode=sc.causal_fill_mode if finite_causal else "replace",
                        # a finite fill of the boolean data mask (masked_fill(~pad, finfo.min)): every plan
                        mask_fill=sc.mask_fill if finite_mask else NEG_INF)
        sq, sk = permuted(shape(q), sc.q_p), permuted(shape(k), sc.k_p)
        summary = {
            "q": user_name(q), "k": user_name(k), "v": user_name(v) if v is not None else "-",
            "scale": describe_scale(sc.factors), "causal": sc.causal, "mask": describe_mask(sc.mask_terms),
            "gqa_group": group, "dtype": str(sc.in_dtype).replace("torch.", ""),
            "shape": f"q{tuple(sq)} k{tuple(sk)}", "outputs": ", ".join(outputs),
            "score": path.describe(rank),
        }
        if finite_causal:
            summary["causal_fill"] = f"{sc.causal_fill:g} ({sc.causal_fill_mode})"
        if finite_mask:
            summary["mask_fill"] = f"{sc.mask_fill:g}"
        if path.describe_slices(rank):
            summary["window"] = path.describe_slices(rank)
            if path.windows and sc.causal != "none":
                summary["window_causal"] = score_causal
        if sc.buffers:
            summary["assumes_constant"] = sorted(set(sc.buffers))
        region = frozenset(b.region) | frozenset(passed) | frozenset(path.nodes) | set(outputs.values())
        inputs = tuple(sc.inputs) + ((v,) if v is not None else ())
        root = pv if pv is not None else colsum
        return Match(self.name, root, region, bindings, summary, location(anchor), ctx.graph_index,
                     inputs=inputs, outputs=outputs)

    # -- planning ------------------------------------------------------------------------
    def candidates(self, m: Match, ctx: MatchContext) -> list[Candidate]:
        from fuser.patterns.h2o_plans import candidates

        return candidates(m, ctx)

    def why_not_offered(self, m: Match, choice: str, value: str) -> str:
        from fuser.patterns.h2o_plans import why_not_offered

        return why_not_offered(m, choice, value)

    def kernels(self, m: Match, plan: Candidate) -> list:
        from fuser.patterns.h2o_plans import kernels_for

        return kernels_for(m, plan)

    # -- emission --------------------------------------------------------------------------
    def emit(self, m: Match, plan: Candidate, graph: fx.Graph) -> dict:
        b = m.bindings
        if plan.params.get("impl") != "fuser":
            raise ValueError(f"h2o plan {plan.name} emits nothing")
        p = plan.params
        text = h2o_ops.plan_string(p["plan"], p["diagonals"], p["cache"], tuple(p.get("tries") or ()))
        e = Emitter(graph, b["rank"], b["compute_dtype"])
        with graph.inserting_before(m.insertion_point):
            # every operand detached: the outputs need no gradient (the match declines otherwise),
            # yet an operand may carry one where the program computed the scores with gradients
            # and only the softmax under torch.no_grad() (a learned temperature): autograd must
            # not try to differentiate the op, which has no backward
            dyn = [(v, p) for v, p in b["factors"] if not isinstance(v, float)]
            q = e.operand(b["q"], b["q_p"], b["in_dtype"], factors=dyn, detach=True)
            k = e.operand(b["k"], b["k_p"], b["in_dtype"], detach=True)
            v = e.operand(b["v"], None, b["in_dtype"], detach=True) if b["v"] is not None else None
            mask = e.mask(b["mask_terms"], b["mask_shape"])
            if mask is not None:
                mask = e.node("call_method", "detach", (mask,))
            # the score's rows: q (and the mask's rows) sliced to the query window, if any; then
            # O comes from the attention op over every row (see _window_out)
            q_rows, mask_rows = window_rows(e, b, q, mask)
            both = v is not None and not b["windows"]
            op = e.node("call_function", torch.ops.fuser.h2o.default,
                        (q_rows, k, v if both else None, mask_rows, e.scale(b["factors"]), b["score_causal"],
                         b["mask_kind"], both, text, b["causal_fill"], b["causal_fill_mode"],
                         b.get("mask_fill", NEG_INF)))
            new = {"score": score_output(e, b, e.node("call_function", operator.getitem, (op, 1)), q_rows)}
            if v is not None:
                out = e.unrank(e.node("call_function", operator.getitem, (op, 0)) if both
                               else window_out(e, b, q, k, v, mask))
                if b["out_dtype"] != b["compute_dtype"]:
                    out = e.node("call_method", "to", (out, b["out_dtype"]))
                new["out"] = out
        return new


# -- emission helpers (the score's reading of P: windows, reductions) ---------------------------

def _mask_has_rows(mask_shape: Optional[tuple]) -> bool:
    """The mask varies along the query axis (its dim -2 is not a broadcast 1)."""
    return mask_shape is not None and len(mask_shape) >= 2 and not (isinstance(mask_shape[-2], int)
                                                                      and mask_shape[-2] == 1)


def window_rows(e: Emitter, b: dict, q: fx.Node, mask: Any) -> tuple:
    """``(q, mask)`` restricted to the score's query window: the same slices of the query axis
    (dim 2 of the 4-D operands) that the program took of P, applied to q and to a mask with
    rows. Exact for any slice: P's rows are the softmax of the same rows of the scores."""
    for s in b["windows"]:
        q = e.node("call_function", operator.getitem, (q, (slice(None), slice(None), s)))
        if mask is not None and _mask_has_rows(b["mask_shape"]):
            mask = e.node("call_function", operator.getitem, (mask, (slice(None), slice(None), s)))
    return q, mask


def window_out(e: Emitter, b: dict, q: fx.Node, k: fx.Node, v: fx.Node, mask: Any) -> fx.Node:
    """``O = P V`` over every query row when the score reads a window of them: the attention
    op's forward (``torch.ops.fuser.attention``, inference: no LSE), 4-D."""
    from . import attention_ops  # noqa: F401  (registers torch.ops.fuser.attention)
    from .attention_plans import plan_string

    # the data mask's fill is the score's (a window under a finite causal fill is declined)
    op = e.node("call_function", torch.ops.fuser.attention.default,
                (q, k, v, mask, e.scale(b["factors"]), b["causal"], b["mask_kind"], False, plan_string({}),
                 b.get("mask_fill", NEG_INF), NEG_INF, "replace", "", [], NEG_INF, "replace"))
    return e.node("call_function", operator.getitem, (op, 0))


def score_output(e: Emitter, b: dict, colsum: fx.Node, q_rows: fx.Node) -> fx.Node:
    """The region's score from the op's column sums ``[B, Hq, Nk]`` (float32): the scores'
    rank restored, then the program's reductions replayed on them with the query axis put back
    as a unit dim (a sum over it is then the identity), a mean over the queries divided by the
    window's row count, cast to the score's dtype. A lone ``P.sum(-2)`` needs no replay."""
    rank, steps = b["rank"], b["score_steps"]
    score = e.unrank(colsum)
    if len(steps) == 1 and steps[0][1] == (rank - 2,) and not steps[0][2]:
        if steps[0][0] == "mean":
            score = e.node("call_function", operator.truediv, (score, _rows(e, q_rows)))
    else:
        score = e.node("call_method", "unsqueeze", (score, rank - 2))
        for op, *args in steps:
            if op == "slice":
                score = e.node("call_function", operator.getitem, (score, args[0]))
                continue
            dims, keepdim, over_queries = args
            score = e.node("call_method", op, (score, dims, keepdim))
            if op == "mean" and over_queries:
                score = e.node("call_function", operator.truediv, (score, _rows(e, q_rows)))
    if b["score_dtype"] != torch.float32:
        score = e.node("call_method", "to", (score, b["score_dtype"]))
    return score


def _rows(e: Emitter, q_rows: fx.Node) -> fx.Node:
    """The number of query rows the score sums (a SymInt under dynamic shapes)."""
    return e.node("call_method", "size", (q_rows, 2))


def _int(x) -> int:
    return int(symint_value(x))


PATTERN = H2OPattern()
