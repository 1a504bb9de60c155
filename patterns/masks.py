"""Mask terms of attention-like scores: what each hides, with which fill, as the kernels take it.

A mask term is a boolean condition (``masked_fill``/``where``: hidden entries get the fill) or an
additive tensor. :func:`static_class` classifies a term computed from sizes and constants — for
every size the graph serves (symbolically, ``fuser/indexmask.py``), or at the one size there is —
as all-visible, causal (top-left/bottom-right) or another index predicate; anything else is data
the kernel loads. :func:`analyze_masks` turns a score chain's terms into the kernels' view: a
causal structure with its fill, an index predicate, at most one boolean data mask with its fill,
additive data masks — and checks that the user's order of application is one the kernels follow.

Fill semantics (issue 8): ``-inf`` hides a key; a finite fill is a value the score takes
("replace", ``masked_fill``/``where``) or that is added to it ("add", additive masks), as eager
computes it. A number added to every score before a finite fill is taken off the fill.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import weakref
from typing import Any, Optional

import sympy
import torch
import torch.fx as fx

from fuser import indexmask
from fuser.graph import GraphView, val
from fuser.pattern import MatchContext
from fuser.static import NotStatic, symint_value


FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def rounds_below(to: torch.dtype, computed_in: torch.dtype) -> bool:
    """Whether a cast to the float dtype ``to`` rounds values computed in ``computed_in``: a
    narrower or another 16-bit float (float32 -> bfloat16, bfloat16 -> float16). The fused kernels
    keep scores and probabilities in float32, so a program that rounds them below the dtype it
    computes in gets a result the kernels would not reproduce."""
    bits = {torch.float16: 16, torch.bfloat16: 16, torch.float32: 32, torch.float64: 64}
    return to != computed_in and bits.get(to, 0) <= bits.get(computed_in, 0)


NEG_INF = float("-inf")


class Decline(Exception):
    """Raised inside the analysis: not fusable, with the reason."""


# --------------------------------------------------------------------------------------------
# Analysis helpers
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SizeFactor:
    """A run-time scale factor ``node.size(dim) ** power`` that has no node in the graph yet
    (SDPA's default scale ``1/sqrt(E)`` under dynamic shapes); emitted by :class:`Emitter`."""

    node: fx.Node
    dim: int
    power: float

    @property
    def name(self) -> str:
        return f"{self.node.name}.size({self.dim})**{self.power:g}"


def round_to(x: float, dt: Optional[torch.dtype]) -> float:
    """``x`` as a tensor of dtype ``dt`` holds it (``finfo(float32).min`` in bfloat16 is ``-inf``)."""
    if dt is None or not dt.is_floating_point:
        return float(x)
    return float(torch.tensor(x, dtype=torch.float64).to(dt))


def _takeable_fill(f: float) -> float:
    """``f``, a fill as the scores finally hold it (scaled, shifted, rounded to their dtype), or
    :class:`Decline` when it is NaN or ``+inf`` (a finite fill that overflows when scaled): eager's
    softmax then gives NaN rows, and the kernels take a finite fill or ``-inf`` only."""
    if f != f or f == math.inf:
        raise Decline(f"the fill {f} (as the scores hold it, after the later scales) gives NaN rows in eager's "
                      "softmax; the fused kernels take a finite fill or -inf")
    return f


def classify_values(vis: torch.Tensor, nq: int, nk: int) -> str:
    """``"none"`` (all visible), ``"top_left"``, ``"bottom_right"`` (top-left wins when Nq == Nk,
    where they coincide) or ``"general"`` for a concrete visible-key pattern."""
    vis = vis.expand(*vis.shape[:-2], nq, nk) if vis.dim() >= 2 else vis.expand(nq, nk)
    flat = vis.reshape(-1, nq, nk)
    first = flat[0]
    if not bool((flat == first).all()):
        return "general"
    if bool(first.all()):
        return "none"
    i = torch.arange(nq, device=first.device)[:, None]
    j = torch.arange(nk, device=first.device)[None, :]
    if bool((first == (j <= i)).all()):
        return "top_left"
    if bool((first == (j <= i + (nk - nq))).all()):
        return "bottom_right"
    return "general"


# Static masks are evaluated at compile time; beyond this many elements (1 GiB of bool) a
# mask of static shape is treated as data instead.
MAX_STATIC_NUMEL = 1 << 30


@dataclasses.dataclass
class MaskClass:
    """A static mask term's structure.

    Attributes:
        cls: ``"none"`` (hides nothing), ``"top_left"`` or ``"bottom_right"`` (causal), or
            ``"pred"`` (another formula over the query and key indices: sliding windows,
            prefix-LM, ...).
        hidden: for an additive term, the value it adds at hidden entries (``-inf`` or finite;
            visible entries add exactly 0); None for boolean terms (their fill is the step's).
        buffers: module buffers the value was computed from (assumed constant).
        formula: for ``"pred"``, the visible-key formula (``fuser/indexmask.py`` form).
    """

    cls: str
    hidden: Optional[float]
    buffers: list
    formula: Any = None


# Per evaluator (one per graph the pass runs on): (node, kind, the slice's nodes, sizes) -> the
# MaskClass or the NotStatic reason. One mask is often read by every layer of a model (a causal
# mask built once and added in each layer's attention): classified once, not once per reader.
# Weak in the evaluator so that nothing outlives the pass; reasons are kept as text, never as
# exceptions (a kept exception holds its frames: see fuser/static.py's StaticEvaluator.slice).
_CLASSES: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def static_class(node: fx.Node, kind: str, sizes: tuple, ctx: MatchContext, at: Optional[fx.Node] = None) -> MaskClass:
    """Classify a mask term computed from sizes and constants alone, for every size the graph
    serves: at the example sizes when it depends on no dynamic size, else symbolically
    (``fuser/indexmask.py``), as the node ``at`` reads it. Raises NotStatic when the term
    depends on data, cannot be proven, or is general (then it is loaded as data, computed at
    run time).

    The answer depends on ``at`` only through the static slice (the in-place writes before
    ``at`` are part of it), so readers that see the same slice share one classification."""
    sl = ctx.evaluator.slice(node, at)
    key = (node, kind, tuple(sl.nodes), tuple(str(s) for s in sizes))
    memo = _CLASSES.setdefault(ctx.evaluator, {})
    hit = memo.get(key)
    if isinstance(hit, str):
        raise NotStatic(hit)
    if hit is not None:
        return dataclasses.replace(hit, buffers=list(hit.buffers))
    try:
        result = _static_class(node, kind, tuple(sizes), ctx, sl, at)
    except NotStatic as exc:
        memo[key] = str(exc)
        raise
    memo[key] = result
    return dataclasses.replace(result, buffers=list(result.buffers))


def _static_class(node: fx.Node, kind: str, sshape: tuple, ctx: MatchContext, sl: Any,
                  at: Optional[fx.Node]) -> MaskClass:
    """:func:`static_class`'s work, on the slice ``sl`` of ``node`` as ``at`` reads it."""
    try:
        mp = indexmask.mask_predicate(node, sl.nodes, kind, ctx.view, ctx.evaluator.constant)
    except indexmask.NotIndexed as exc:
        if sl.symbols:
            raise NotStatic(f"its structure under dynamic sizes is not proven ({exc})") from None
        mp = None  # a constant of another form: evaluated below at the only size there is
    if mp is not None:
        prover = indexmask.Prover(indexmask.shape_env_of(ctx.view))
        cls = indexmask.classify(mp.visible, sshape[-2], sshape[-1], prover)
        if cls in ("none", "top_left", "bottom_right"):
            return MaskClass(cls, mp.hidden_value, sl.buffers)
        return MaskClass("pred", mp.hidden_value, sl.buffers, formula=mp.visible)
    if ctx.evaluator.max_numel(node, at=at) > MAX_STATIC_NUMEL:
        raise NotStatic(f"too large to evaluate at compile time (> {MAX_STATIC_NUMEL} elements)")
    try:
        value = torch.as_tensor(ctx.evaluator.evaluate(node, at=at))
    except NotStatic:
        raise
    except Exception as exc:  # noqa: BLE001
        raise NotStatic(f"evaluation failed: {exc!r}") from None
    nq, nk = int(symint_value(sshape[-2])), int(symint_value(sshape[-1]))
    if value.dim() < 2:
        value = value.reshape((1,) * (2 - value.dim()) + tuple(value.shape))
    if value.shape[-2] not in (1, nq) or value.shape[-1] not in (1, nk):
        raise NotStatic(f"mask of shape {tuple(value.shape)} for {nq}x{nk} scores")
    hidden = None
    if kind == "bool_keep":
        vis = value.bool()
    elif kind == "bool_drop":
        vis = ~value.bool()
    else:
        # in the mask's own dtype (every value of it is exact there): one nonzero value at most,
        # found by its least and greatest (a sort, torch.unique, costs ~25 ms at 1024x1024)
        if value.is_floating_point() and bool(torch.isnan(value).any()):
            raise NotStatic("an additive mask with NaN entries")
        vis = value == 0
        others = value[~vis]
        hidden = None
        if others.numel():
            lo, hi = float(others.min()), float(others.max())
            if lo != hi:
                raise NotStatic("an additive mask with more than one nonzero value")
            hidden = lo
    cls = classify_values(vis, nq, nk)
    if cls == "general":
        raise NotStatic("a general static mask")
    return MaskClass(cls, hidden, sl.buffers)


def _positive(v: Any, depth: int = 0) -> bool:
    """A scale factor provably > 0: a positive number, a size, or products, quotients, powers
    and square roots of those (``math.sqrt(q.size(-1))``, ``N ** -0.5``); a run-time tensor
    never is."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return v > 0
    if isinstance(v, SizeFactor):
        return True  # size ** power, with a size >= 1
    if not isinstance(v, fx.Node) or depth > 16:
        return False
    x = val(v)
    if isinstance(x, (torch.SymInt, torch.SymFloat)) and bool(x.node.expr.is_positive):
        return True
    if not isinstance(x, (torch.SymInt, torch.SymFloat, int, float)) or v.op != "call_function":
        return False
    name = getattr(v.target, "__name__", "")
    args = [a for a in v.args]
    if name in ("sqrt", "_sym_sqrt", "sym_sqrt") and len(args) == 1:
        return _positive(args[0], depth + 1)
    if v.target in (operator.mul, operator.truediv) and len(args) == 2:
        return _positive(args[0], depth + 1) and _positive(args[1], depth + 1)
    if v.target is operator.pow and len(args) == 2:
        return _positive(args[0], depth + 1)
    if name in ("sym_float", "sym_int") and len(args) == 1:
        return _positive(args[0], depth + 1)
    return False


def static_product(factors: list) -> float:
    """Π value**power over the factors known at compile time (floats)."""
    total = 1.0
    for v, p in factors:
        if isinstance(v, float):
            total = total * v if p == 1 else total / v
    return total


# Kernel order of mask terms: additive data ("A"), then the boolean data term ("R"), then the
# causal structure ("C"); user programs may apply them in any order where that commutes.
_KERNEL_RANK = {"A": 0, "R": 1, "C": 2, "P": 3}


def _commutes(later: tuple, earlier: tuple) -> bool:
    """Whether term ``later`` (applied by the kernel later, by the user earlier) and
    ``earlier`` give the same scores in either order. Terms: (role, fill, mode)."""
    (r1, f1, m1), (r2, f2, m2) = later, earlier
    r1, r2 = ("C" if r1 == "P" else r1), ("C" if r2 == "P" else r2)  # a predicate acts as the causal mask
    later, earlier = (r1, f1, m1), (r2, f2, m2)
    pair = {r1, r2}
    if pair == {"C"}:
        return f1 == NEG_INF and f2 == NEG_INF
    if pair == {"C", "A"}:
        c = later if r1 == "C" else earlier
        return c[1] == NEG_INF or c[2] == "add"
    if pair == {"C", "R"}:
        return f1 == NEG_INF and f2 == NEG_INF
    if pair == {"R", "A"}:
        rr = later if r1 == "R" else earlier
        return rr[1] == NEG_INF
    return True


def analyze_masks(terms: list, score_scales: list, sizes: tuple, rank: int, score_dtype: torch.dtype,
                  ctx: MatchContext, predicates: bool = False) -> dict:
    """The mask terms of one score chain as the kernels take them.

    Args:
        terms: in the user's order (applied first first): dicts with ``kind`` (``"additive"``,
            ``"bool_keep"``, ``"bool_drop"``), ``node``, ``start`` (how many of
            ``score_scales`` were applied before it), ``neg`` (subtracted), ``fill`` (for
            boolean terms: the value hidden scores get, rounded to the scores' dtype), ``shift``
            (for boolean terms: the number added to every score before it, None if not known)
            and ``at`` (the node that reads the mask).
        score_scales: the scale factors applied to the scores, innermost first.
        sizes: ``(Nq, Nk)`` of the scores.
        rank: the scores' rank.
        score_dtype: the dtype of the scores the softmax reads.
        predicates: the kernels evaluate index predicates (else such masks are loaded as data).

    Returns:
        ``Scores`` fields: ``causal``, ``causal_fill``, ``causal_fill_mode``, ``mask_terms``,
        ``mask_fill``, ``buffers``, and the ``pred*`` fields.

    Raises:
        Decline: a combination the kernels cannot compute exactly.
    """
    # A static term (computed from sizes and constants) that hides nothing is dropped; a
    # causal one becomes the kernels' causal structure with its fill; anything else is a
    # tensor the kernel loads tile by tile (several are summed into one additive mask at
    # emit time). A finite fill is a value, computed exactly; only -inf hides a key.
    causal, causal_fill, causal_mode = "none", NEG_INF, "replace"
    preds: list = []  # (formula, fill, mode)
    buffers: list = []
    mask_terms: list = []
    seq: list = []  # (role, fill, mode) in the user's order, for the commutation check
    out_dtype = score_dtype
    for t in terms:
        later = score_scales[t["start"]:]
        later_static = all(isinstance(v, float) for v, _ in later)
        factor = static_product(later) if later_static else None
        if t["kind"] != "additive":
            if factor is None and t["fill"] == NEG_INF and all(_positive(v) for v, _ in later):
                factor = static_product(later)  # -inf times a positive size expression stays -inf
            if factor is None:
                raise Decline("a masked_fill/where comes before a scale known only at run time; its fill "
                              "would need that value")
            if factor <= 0:
                raise Decline(f"a masked_fill/where comes before a scale of {factor}; only positive scales "
                              "keep hidden keys hidden")
            shift = t.get("shift", 0.0)
            if shift is None and t["fill"] != NEG_INF:
                raise Decline("a masked_fill/where with a finite fill comes after a shift of the scores that is "
                              "only known at run time")
            t["fill_eff"] = _takeable_fill(round_to((t["fill"] - (shift or 0.0)) * factor, out_dtype))
        try:
            mc = static_class(t["node"], t["kind"], sizes, ctx, at=t["at"])
            buffers += mc.buffers
            cls = mc.cls
        except NotStatic:
            mc, cls = None, "data"
        if cls == "none":
            continue
        if cls == "pred" and not predicates:
            cls = "data"
        if cls in ("top_left", "bottom_right", "pred"):
            if t["kind"] == "additive":
                if factor is None or factor <= 0 or t["neg"] or mc.hidden is None:
                    cls = "data"
                else:
                    value, mode = _takeable_fill(round_to(mc.hidden * factor, out_dtype)), "add"
            else:
                value, mode = t["fill_eff"], "replace"
        if cls == "pred":
            preds.append((mc.formula, value, "replace" if value == NEG_INF else mode))
            seq.append(("P", value, mode))
            continue
        if cls in ("top_left", "bottom_right"):
            if value == NEG_INF:
                mode = "replace"
            if causal != "none":
                if cls != causal:
                    raise Decline("two causal masks with different alignments")
                if value != NEG_INF or causal_fill != NEG_INF:
                    raise Decline("two causal masks, one with a finite fill: the fused kernels apply one")
                continue
            causal, causal_fill, causal_mode = cls, value, mode
            seq.append(("C", value, mode))
            continue
        val_m = val(t["node"])
        if val_m.requires_grad and ctx.grad_enabled:
            raise Decline("the additive bias requires grad; fuser's kernels do not compute dBias")
        if val_m.dim() > rank:
            raise Decline(f"mask of rank {val_m.dim()} for scores of rank {rank}")
        if t["kind"] == "additive" and val_m.dtype not in FLOATS + (torch.float64,):
            raise Decline(f"additive mask of dtype {val_m.dtype}")
        if t["kind"] != "additive" and val_m.dtype != torch.bool:
            raise Decline(f"mask condition of dtype {val_m.dtype} (expected bool)")
        fill = t.get("fill_eff", None)
        mask_terms.append(dict(
            kind=t["kind"], node=t["node"], neg=t["neg"], shape=tuple(val_m.shape),
            scale=later if t["kind"] == "additive" else [], fill=NEG_INF if fill is None else fill,
        ))
        seq.append(("A", None, None) if t["kind"] == "additive" else ("R", fill, "replace"))
    finite = [t for t in mask_terms if t["kind"] != "additive" and t["fill"] != NEG_INF]
    if finite and len(mask_terms) > 1:
        raise Decline(f"a masked_fill/where with the finite value {finite[0]['fill']:g} combined with other mask "
                      "tensors; the fused kernels apply one such mask")
    for i, first in enumerate(seq):
        for second in seq[i + 1:]:
            if _KERNEL_RANK[first[0]] > _KERNEL_RANK[second[0]] and not _commutes(first, second):
                raise Decline("masks with finite fills applied in an order the fused kernels do not follow "
                              "(they apply additive masks, then a masked_fill, then the causal mask)")
    out = dict(causal=causal, causal_fill=causal_fill, causal_fill_mode=causal_mode, mask_terms=mask_terms,
               mask_fill=finite[0]["fill"] if finite else NEG_INF, buffers=buffers)
    if preds:
        out.update(_predicate(preds, out, sizes, ctx))
    return out


def _predicate(preds: list, masks: dict, sizes: tuple, ctx: MatchContext) -> dict:
    """The ``pred*`` fields for the index-predicate mask terms ``preds`` (formula, fill,
    mode): several, and a causal structure, are combined into one predicate when they all hide
    with ``-inf`` (AND of what each leaves visible)."""
    formulas = [f for f, _, _ in preds]
    fills = {(v, m) for _, v, m in preds}
    if len(preds) > 1 and fills != {(NEG_INF, "replace")}:
        raise Decline("several index masks, one with a finite fill: the fused kernels apply one")
    fill, mode = preds[0][1], preds[0][2]
    if masks["causal"] != "none":
        if masks["causal_fill"] != NEG_INF or fill != NEG_INF:
            raise Decline("a causal mask and another index mask with a finite fill: the fused kernels apply one")
        offset = 0 if masks["causal"] == "top_left" else sympy.sympify(_expr_of(sizes[1])) - sympy.sympify(_expr_of(sizes[0]))
        formulas.append(("atom", indexmask.Atom.make({-2: 1, -1: -1}, offset)))
        masks.update(causal="none")
    formula = ("and", *formulas) if len(formulas) > 1 else formulas[0]
    consts: list = []
    pred = _codegen_formula(formula, consts)
    sources = _size_sources(ctx.view, consts)
    return dict(pred=pred, pred_consts=tuple(consts), pred_fill=fill, pred_fill_mode=mode, size_sources=sources)


def _expr_of(x: Any) -> Any:
    return x.node.expr if isinstance(x, torch.SymInt) else x


def _codegen_formula(p: tuple, consts: list) -> tuple:
    """An ``indexmask`` formula over axes -2 (i) and -1 (j) in ``codegen/predicate.py``'s
    form; atom constants are appended to ``consts``."""
    if p == indexmask.TRUE:
        return ("true",)
    if p == indexmask.FALSE:
        return ("false",)
    if p[0] == "atom":
        coef = dict(p[1].coef)
        if set(coef) - {-2, -1}:
            raise Decline("an index mask that depends on batch or head indices")
        consts.append(p[1].const)
        return ("atom", int(coef.get(-2, 0)), int(coef.get(-1, 0)), len(consts) - 1)
    return (p[0], *[_codegen_formula(x, consts) for x in p[1:]])


def _size_sources(view: GraphView, consts: list) -> dict:
    """symbol -> ``(node, dim)``: the first graph value holding each size symbol the constants
    use (a size placeholder, ``dim`` None, or a tensor's dim). Declines a constant that is not
    a sum of integer multiples of sizes, or a size no graph value holds."""
    need: set = set()
    for c in consts:
        if isinstance(c, sympy.Basic):
            for term in sympy.Add.make_args(sympy.expand(c)):
                coeff, rest = term.as_coeff_Mul()
                if not (coeff.is_Integer and (rest == 1 or rest.is_Symbol)):
                    raise Decline(f"an index mask whose constant {c} is not linear in the sizes")
            need |= c.free_symbols
    found: dict = {}
    for n in view.nodes:
        if not need - set(found):
            break
        v = val(n)
        if isinstance(v, torch.SymInt) and n.op == "placeholder" and v.node.expr in need:
            found.setdefault(v.node.expr, (n, None))
        elif isinstance(v, torch.Tensor):
            for d, size in enumerate(v.shape):
                if isinstance(size, torch.SymInt) and size.node.expr in need:
                    found.setdefault(size.node.expr, (n, d))
    missing = need - set(found)
    if missing:
        raise Decline(f"an index mask uses sizes {sorted(map(str, missing))} that no input holds")
    return found


def describe_mask(terms: list) -> str:
    desc = [f"{t['kind']} {t['shape']}" for t in terms]
    if not desc:
        return "none"
    if len(desc) == 1:
        return desc[0]
    return "additive, combined from " + " + ".join(desc)
