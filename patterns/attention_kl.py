"""Attention-KL: ``KL(P1 ‖ P2)`` between two attention distributions over the same keys.

``P1 = softmax(S1)`` (the target, usually a teacher's attention) and ``P2 = softmax(S2)`` (the
student's), ``S = scale · Q Kᵀ`` with the same causal/padding mask on both sides (head dims may
differ; GQA on either side). Per query row ``L_i = Σ_j P1_ij (log P1_ij − log P2_ij)``, then the
user's reduction. Recognised spellings of the elementwise term:

- ``F.kl_div(log_softmax(S2), log_softmax(S1), log_target=True)``
- ``F.kl_div(log_softmax(S2), softmax(S1))`` (also with ``log(softmax(S2))`` as input)
- ``p1 * (log_softmax(s1) - log_softmax(s2))`` and ``p1 * (log(p1) - log(p2))``

reduced by ``kl_div``'s ``sum``/``mean``/``batchmean`` (``mean`` divides by every element, N_k
included; ``batchmean`` by dim 0 only), or ``none``/hand-written followed by ``.sum(-1)`` (per
row), ``.sum()`` or ``.mean()``; terms zeroed under the scores' own mask first
(``masked_fill(mask, 0)`` / ``where``) are accepted. The fused kernels stream over key tiles and
never materialise P1 or P2; the math (offset-free accumulator, exact split-K merge, backward) is
in docs/math.md and ``codegen/attention_kl.py``.
"""

from __future__ import annotations

from typing import Optional

import torch.fx as fx

from fuser.graph import GraphView, dtype, location, shape, val
from fuser.names import user_name
from fuser.matcher import Alt, Op, Same, match
from fuser.pattern import Candidate, Match, MatchContext, Pattern, Rejection
from fuser.static import NotStatic

from . import attention_kl_ops  # noqa: F401  (registers torch.ops.fuser.attention_kl and its backward)
from .attention import decline_cut_inputs, score_inputs
from .masks import NEG_INF, Decline, describe_mask, static_class
from .scores import Scores, _same_dims, analyze_scores, describe_scale, scores_rule, softmax_rule

# --------------------------------------------------------------------------------------------
# Spelling (side 1 = target P1, side 2 = input log P2)
# --------------------------------------------------------------------------------------------

_LOGP2 = Alt(
    Op("log_softmax", scores_rule("2"), name="logp2"),
    Op("log", softmax_rule("2"), name="logp2"),
)
TERM = Alt(
    Op("kl_div", _LOGP2, Op("log_softmax", scores_rule("1"), name="logp1"), name="term",
       check=lambda c: c.attrs["log_target"]),
    Op("kl_div", _LOGP2, softmax_rule("1"), name="term", check=lambda c: not c.attrs["log_target"]),
    Op("mul", softmax_rule("1"),
       Op("sub", Alt(Op("log_softmax", Same("S1"), name="logp1"), Op("log", Same("softmax1"), name="logp1")), _LOGP2),
       commutative=True, name="term"),
)
# between the elementwise term and its reduction
_TERM_THROUGH = frozenset({"cast", "identity"})


def _is_zero(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == 0


class AttentionKLPattern(Pattern):
    """KL divergence between two attention distributions (attention distillation)."""

    name = "attention_kl"
    plan_choices = {
        "impl": ("fuser", "inductor"),
        "split_k": ("1", "auto", "<positive integer>"),
        "backward": ("two_kernel", "atomic_dq"),
    }

    def anchors(self, view: GraphView):
        for n in view.graph.nodes:
            if view.op(n) in ("kl_div", "mul"):
                yield n

    def match(self, anchor: fx.Node, ctx: MatchContext) -> Match | Rejection | None:
        first: Optional[Rejection] = None
        found = False
        for b in match(TERM, anchor, ctx.view):
            found = True
            red = self._reduction(anchor, ctx.view, b)
            if red is None:
                return None
            if isinstance(red, str):
                return Rejection(self.name, red, location(anchor), anchor.name, ctx.graph_index)
            try:
                return self._analyze(b, anchor, red, ctx)
            except Decline as exc:
                first = first or Rejection(self.name, str(exc), location(anchor), anchor.name, ctx.graph_index)
        if not found:
            why = _detached_after_softmax(anchor, ctx.view)
            if why:
                return Rejection(self.name, why, location(anchor), anchor.name, ctx.graph_index)
        return first

    # -- the reduction after the elementwise term -------------------------------------------
    def _reduction(self, term: fx.Node, view: GraphView, b):
        """``(root, kind, keepdim, passed, zeroing)`` with kind in rows/sum/mean/batchmean; None
        when the term feeds no reduction fuser knows; a reason string for a near-miss."""
        c = view.canon(term)
        rank = len(shape(term)) if shape(term) is not None else None
        if c.op == "kl_div" and c.attrs["reduction"] != "none":
            if c.attrs["reduction"] not in ("sum", "mean", "batchmean"):
                return f"kl_div reduction {c.attrs['reduction']!r}"
            return term, c.attrs["reduction"], False, [], []
        x, passed, zeroing = term, [], []
        while True:
            readers = view.readers(x)
            if len(readers) != 1:
                return None
            r = readers[0]
            rc = view.canon(r)
            if rc is None:
                return None
            if rc.op in _TERM_THROUGH and rc.args[0] is x:
                passed.append(r)
                x = r
                continue
            if rc.op == "masked_fill" and rc.args[0] is x and _is_zero(rc.args[2]):
                zeroing.append(("bool_drop", rc.args[1], r))
            elif rc.op == "where" and rc.args[2] is x and _is_zero(rc.args[1]):
                zeroing.append(("bool_drop", rc.args[0], r))
            elif rc.op == "where" and rc.args[1] is x and _is_zero(rc.args[2]):
                zeroing.append(("bool_keep", rc.args[0], r))
            elif rc.op == "sum" and rc.args[0] is x:
                dims = rc.attrs["dim"]
                if dims == (rank - 1,):
                    return r, "rows", rc.attrs["keepdim"], passed, zeroing
                if dims is None or set(dims) == set(range(rank)):
                    return r, "sum", False, passed, zeroing
                return f"the KL terms are summed over dims {dims}, not over the keys or everything"
            elif rc.op == "mean" and rc.args[0] is x:
                if rc.attrs["dim"] is None or set(rc.attrs["dim"]) == set(range(rank)):
                    return r, "mean", False, passed, zeroing
                return f"the KL terms are averaged over dims {rc.attrs['dim']}"
            else:
                return None
            passed.append(r)
            x = r

    # -- analysis -----------------------------------------------------------------------------
    def _analyze(self, b, term: fx.Node, red, ctx: MatchContext) -> Match:
        root, kind, keepdim, passed, zeroing = red
        view = ctx.view
        s1, s2 = analyze_scores(b, ctx, "1"), analyze_scores(b, ctx, "2")
        rank = s1.rank
        if s2.rank != rank:
            raise Decline(f"the two score matrices have ranks {s1.rank} and {s2.rank}")
        for name in ("softmax1", "softmax2", "logp1", "logp2"):
            n = b.get(name)
            c = view.canon(n) if n is not None else None
            if c is not None and c.op in ("softmax", "log_softmax") and c.attrs["dim"] != rank - 1:
                raise Decline(f"{c.op} over dim {c.attrs['dim']}, not over the keys (last dim)")
        (nq1, nk1, d1), (nq2, nk2, d2) = s1.dims(), s2.dims()
        b1 = tuple(shape(s1.q)[:-2])
        b2 = tuple(shape(s2.q)[:-2])
        if not _same_dims(b1 + (nq1, nk1), b2 + (nq2, nk2)):
            raise Decline(f"the two attentions have different shapes (q1 {shape(s1.q)}, q2 {shape(s2.q)}, Nk {nk1} vs {nk2})")
        if s1.in_dtype != s2.in_dtype:
            raise Decline(f"teacher and student dtypes differ ({s1.in_dtype}, {s2.in_dtype})")
        if s1.compute_dtype != s2.compute_dtype:
            # e.g. one side's scores under torch.autocast: the kernels take one dtype for both sides
            raise Decline(f"the teacher's scores are computed in {s1.compute_dtype}, the student's in "
                          f"{s2.compute_dtype} (torch.autocast around one side only?); the kernels take one dtype")
        if s1.device != s2.device:
            raise Decline("teacher and student are on different devices")
        if s1.causal != s2.causal or not _same_masks(s1, s2) or s1.causal_fill_mode != s2.causal_fill_mode \
                or (s1.causal_fill == NEG_INF) != (s2.causal_fill == NEG_INF):
            same_text = (s1.causal == s2.causal and describe_mask(s1.mask_terms) == describe_mask(s2.mask_terms)
                         and s1.causal_fill_mode == s2.causal_fill_mode)
            nodes = [f"'{a['node'].name}' / '{c['node'].name}'" for a, c in zip(s1.mask_terms, s2.mask_terms)
                     if a["node"] is not c["node"]]
            hint = (f": each side computes its own mask tensor ({', '.join(nodes)}); fuser compares them as tensors, "
                    "so compute the mask once and use it on both sides") if same_text and nodes else ""
            raise Decline(
                f"the masks differ between the two sides (causal {s1.causal} vs {s2.causal}; "
                f"{describe_mask(s1.mask_terms)} vs {describe_mask(s2.mask_terms)}){hint}"
            )
        for t in s1.mask_terms:
            if t["kind"] == "additive" and t["scale"]:
                raise Decline("an additive mask added before the scale (it would differ per side)")
        zero_hidden, zeroed = _zero_hidden(zeroing, s1, s2, ctx)
        _check_finite_terms(view.canon(term), s1, s2, zeroed)

        # A side under torch.no_grad() (or detached) gets no gradient: Dynamo keeps no_grad
        # blocks as grad-mode switches, and the values it recorded tell which nodes carry one.
        live = ctx.grad_enabled and bool(val(root).requires_grad)
        g1 = live and not _detached(b, "1", s1) and s1.requires_grad()
        g2 = live and not _detached(b, "2", s2) and s2.requires_grad()
        for side, s, g in (("teacher", s1, g1), ("student", s2, g2)):
            if g:
                _check_gradient_cuts(side, s, root, view)
        region = frozenset(b.region) | frozenset(passed) | {root}
        bindings = dict(
            s1=s1, s2=s2, rank=rank, reduction=kind, keepdim=keepdim, out_dtype=dtype(root),
            grad_teacher=bool(g1), grad_student=bool(g2), need_stats=bool(g1 or g2),
            causal=s1.causal, mask_terms=s1.mask_terms, mask_kind=s1.mask_kind, mask_shape=s1.mask_shape,
            causal_fill_mode=s1.causal_fill_mode, device=s1.device, in_dtype=s1.in_dtype, zero_hidden=zero_hidden,
        )
        spelling = {
            "kl_div": "kl_div(log_target=True)" if view.canon(term).attrs.get("log_target") else "kl_div(probs)",
            "mul": "p1 * (log p1 - log p2)",
        }[view.canon(term).op]
        summary = {
            "teacher": f"q={user_name(s1.q)} k={user_name(s1.k)}",
            "student": f"q={user_name(s2.q)} k={user_name(s2.k)}",
            "scale1": describe_scale(s1.factors),
            "scale2": describe_scale(s2.factors),
            "causal": s1.causal,
            "mask": describe_mask(s1.mask_terms),
            "gqa_groups": (s1.group, s2.group),
            "head_dims": (d1, d2),
            "reduction": kind,
            "spelling": spelling,
            "grads": "both sides" if g1 and g2 else "student only" if g2 else "teacher only" if g1 else "none",
            "dtype": str(s1.in_dtype).replace("torch.", ""),
        }
        if s1.causal != "none" and s1.causal_fill != NEG_INF:
            summary["causal_fill"] = f"{s1.causal_fill:g}/{s2.causal_fill:g} ({s1.causal_fill_mode})"
        if s1.mask_fill != NEG_INF:
            summary["mask_fill"] = f"{s1.mask_fill:g}/{s2.mask_fill:g}"
        if zero_hidden:
            summary["zeroed"] = "the hidden keys' terms (they still count in both softmaxes)"
        buffers = sorted(set(s1.buffers + s2.buffers))
        if buffers:
            summary["assumes_constant"] = buffers
        return Match(self.name, root, region, bindings, summary, location(term), ctx.graph_index,
                     inputs=tuple(s1.inputs) + tuple(s2.inputs))

    # -- planning and emission ----------------------------------------------------------------
    def candidates(self, m: Match, ctx: MatchContext) -> list[Candidate]:
        from .attention_kl_plans import candidates

        return candidates(m, ctx)

    def kernels(self, m: Match, plan: Candidate) -> list:
        from .attention_kl_plans import kernels

        return kernels(m, plan)

    def emit(self, m: Match, plan: Candidate, graph: fx.Graph) -> fx.Node:
        from .attention_kl_plans import emit

        return emit(m, plan, graph)


def _same_masks(s1: Scores, s2: Scores) -> bool:
    """Both sides load the same mask tensor(s) with the same meaning."""
    if len(s1.mask_terms) != len(s2.mask_terms):
        return False
    for a, c in zip(s1.mask_terms, s2.mask_terms):
        if a["kind"] != c["kind"] or a["node"] is not c["node"] or a["neg"] != c["neg"]:
            return False
        if describe_scale(a["scale"]) != describe_scale(c["scale"]):
            return False
    return True


def _zeroing_target(kind: str, cond, s: Scores, ctx: MatchContext, at=None):
    """What a ``masked_fill(term, cond, 0)``/``where`` on the KL terms zeroes: ``"causal"`` (the
    entries the scores' causal structure hides), ``("mask", node)`` (those the boolean mask term
    ``node`` hides), ``"nothing"`` (a condition that hides nothing), or None (anything else)."""
    for t in s.mask_terms:
        if t["node"] is cond and t["kind"] == kind:
            return ("mask", cond) if kind != "additive" else None
    try:
        mc = static_class(cond, kind, tuple(shape(s.node)[-2:]), ctx, at=at)
    except NotStatic:
        return None
    if mc.cls == "none":
        return "nothing"
    return "causal" if mc.cls == s.causal else None


def _zero_hidden(zeroing: list, s1: Scores, s2: Scores, ctx: MatchContext) -> tuple:
    """``(zero_hidden, zeroed)``: whether the KL terms are zeroed where the scores' masks hide
    keys and the kernels must exclude those terms (``zero_hidden``: only with a finite fill; with
    ``-inf`` the kernels' hidden terms are 0 already), and what the zeroing covers (``"causal"``,
    ``("mask", node)``). Raises Decline when the zeroing is not exactly that."""
    targets = []
    for zkind, cond, reader in zeroing:
        t = _zeroing_target(zkind, cond, s1, ctx, at=reader)
        if t is None:
            raise Decline("the KL terms are zeroed by a mask other than the scores' mask")
        targets.append(t)
    zeroed = set(targets) - {"nothing"}
    finite = any(f != NEG_INF for s in (s1, s2) for f in (s.mask_fill, s.causal_fill))
    if not zeroing or not finite:
        return False, zeroed
    hiding = ({"causal"} if s1.causal != "none" else set()) | {("mask", t["node"]) for t in s1.mask_terms}
    if any(t["kind"] == "additive" for t in s1.mask_terms) or zeroed != hiding:
        raise Decline("with a finite fill, the KL terms must be zeroed exactly where the scores' masks hide keys")
    return True, zeroed


def _minus_inf_hidden(s: Scores) -> set:
    """The structures that hide keys of side ``s`` with a ``-inf`` score: ``"causal"``, ``("mask",
    node)`` for a boolean term, ``"predicate"`` (an additive term's values are data: not here)."""
    out = set()
    if s.causal != "none" and s.causal_fill == NEG_INF:
        out.add("causal")
    for t in s.mask_terms:
        if t["kind"] != "additive" and t.get("fill", NEG_INF) == NEG_INF:
            out.add(("mask", t["node"]))
    if s.pred is not None and s.pred_fill == NEG_INF:
        out.add("predicate")
    return out


def _check_finite_terms(term, s1: Scores, s2: Scores, zeroed: set) -> None:
    """Decline where eager's KL terms on hidden keys are not finite and nothing zeroes them: with a
    ``-inf`` fill, ``p1 · (log p1 − log p2)`` and ``kl_div(log_target=True)`` give ``0 · (−∞) =
    NaN`` (teacher hidden) or ``+∞`` (student hidden alone), and ``kl_div`` of probabilities,
    ``xlogy(p1, p1) − p1 · log p2``, gives NaN or ``+∞`` where the student's entry is ``-inf``.
    The kernels' terms there are 0 (they never form ``0 · (−∞)``), so the op would turn eager's NaN
    loss into a finite one. (An additive mask holding ``-inf`` is data: README, Limits.)"""
    probs = term.op == "kl_div" and not term.attrs.get("log_target")
    risky = _minus_inf_hidden(s2) if probs else _minus_inf_hidden(s1) | _minus_inf_hidden(s2)
    left = risky - zeroed
    if left:
        what = ", ".join(sorted("the causal mask" if r == "causal" else "the index predicate" if r == "predicate"
                                else f"the mask '{r[1].name}'" for r in left))
        raise Decline(f"{what} hides keys with -inf and the KL terms there are not zeroed: eager's terms on those "
                      "keys are 0 * (-inf) = NaN (or +inf), so its loss is NaN; zero them (kl.masked_fill(hidden, 0)) "
                      "or fill with a finite value (torch.finfo(dtype).min)")


def _check_gradient_cuts(side: str, s: Scores, root: fx.Node, view: GraphView) -> None:
    """Decline when the op would give one of a side's inputs a gradient that eager does not: the
    side's gradient flows, but a ``torch.no_grad()`` block or ``.detach()`` cuts one input's path
    (``q * c`` under no_grad folded into the scale, ``k.mT`` under no_grad), while the op reads the
    input itself. (A side cut as a whole — its softmax without gradients — is :func:`_detached`.)"""
    k = s.k_ungrouped if s.k_ungrouped is not None else s.k  # as the op reads it: before a GQA repeat
    decline_cut_inputs(score_inputs(s, k), root, view, "the KL", owner=f"the {side}'s ")


def _detached_after_softmax(term: fx.Node, view: GraphView) -> Optional[str]:
    """Why a KL term that does not match reads a ``.detach()`` of a softmax or log-softmax
    (``F.softmax(s1, -1).detach()``), when it does: the spelling fuser takes detaches the scores
    (the same values and gradients). None when the term has no such operand, or is no KL term
    (a ``mul`` whose operands hold no log-probabilities)."""
    if view.op(term) not in ("kl_div", "mul"):
        return None
    operands = [a for a in term.args if isinstance(a, fx.Node)]
    operands += [a for x in operands if view.op(x) == "sub" for a in x.args if isinstance(a, fx.Node)]
    if view.op(term) == "mul" and not any(view.op(x) in ("log_softmax", "log", "sub") for x in operands):
        return None
    for x in operands:
        c = view.canon(x)
        if c is not None and c.op == "detach" and isinstance(c.args[0], fx.Node) \
                and view.op(c.args[0]) in ("softmax", "log_softmax"):
            return (f"'{x.name}' ({location(x)}) detaches the output of a {view.op(c.args[0])} ('{c.args[0].name}'); "
                    "fuser takes the KL when the scores are detached instead (softmax(s.detach(), -1): the same "
                    "values and gradients) or the side is computed under torch.no_grad()")
    return None


def _detached(b, tag: str, s: Scores) -> bool:
    """No gradient flows from the KL back to side ``tag``'s scores: a ``detach``, or a softmax
    / log-softmax of that side computed under ``torch.no_grad()``."""
    if s.detached:
        return True
    nodes = [b.get(f"softmax{tag}"), b.get(f"logp{tag}")]
    return s.requires_grad() and any(n is not None and not val(n).requires_grad for n in nodes)


PATTERN = AttentionKLPattern()
