"""The scores shared by the softmax-anchored patterns: ``softmax(scale · Q Kᵀ + masks)``.

Attention, attention-KL and H2O all start from the same scores. This module holds their
spelling (rules parameterised by a tag, so one pattern can match two score chains, e.g. the
teacher's and the student's) and their analysis: the scale (numbers, symbolic sizes, tensors
built from sizes), masks proven by their values (causal top-left/bottom-right, all-visible,
general), GQA head repeats undone, operand layouts. Every decline carries its reason.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Optional

import torch
import torch.fx as fx

from fuser.graph import COp, GraphView, dtype, is_tensor, ndim, shape, val
from fuser.matcher import HOLE, Alt, Bindings, Chain, Op, Rule, Same, Var
from fuser.pattern import MatchContext
from fuser.static import NotStatic, symint_value

_LAST_KEEPDIM = lambda c: c.attrs.get("keepdim") and c.attrs.get("dim") in ((ndim(c.args[0]) - 1,),)  # noqa: E731

# Transforms between Q Kᵀ and the softmax, applied to the scores S (HOLE), outermost first.
SCORE_STEPS = (
    Op({"mul", "div"}, HOLE, Var("factor"), label="scale"),
    Op("mul", Var("factor"), HOLE, label="scale"),
    Op("add", HOLE, Var("bias"), label="add"),
    Op("add", Var("bias"), HOLE, label="add"),
    Op("sub", HOLE, Var("bias"), label="sub"),
    Op("masked_fill", HOLE, Var("cond"), Var("fill"), label="masked_fill"),
    Op("where", Var("cond"), HOLE, Var("fill"), label="where_keep"),
    Op("where", Var("cond"), Var("fill"), HOLE, label="where_drop"),
    Op({"cast", "identity"}, HOLE, label="cast"),
    Op("detach", HOLE, label="detach"),
)


def scores_rule(tag: str = "") -> Rule:
    """``scale · Q Kᵀ`` through any chain of :data:`SCORE_STEPS`. Binds ``S<tag>`` (the
    chain's outermost node: what the softmax reads), ``steps<tag>``, ``qk<tag>``, ``q<tag>``,
    ``kT<tag>`` and, for ``baddbmm``, ``bias0<tag>``."""
    qk = Alt(
        Op("matmul", Var(f"q{tag}"), Var(f"kT{tag}"), name=f"qk{tag}"),
        Op("baddbmm", Var(f"bias0{tag}"), Var(f"q{tag}"), Var(f"kT{tag}"), name=f"qk{tag}"),
    )
    return Chain(qk, SCORE_STEPS, name=f"steps{tag}", root=f"S{tag}")


def softmax_rule(tag: str = "") -> Rule:
    """A softmax over the last dim of :func:`scores_rule`: ``softmax`` (any spelling) or by hand
    ``exp(S - amax(S)) / sum(...)`` (also without the max). Binds ``softmax<tag>``."""
    scores = scores_rule(tag)
    e = Alt(
        Op("exp", Op("sub", scores, Op("amax", Same(f"S{tag}"), through={"detach"}, check=_LAST_KEEPDIM)), name=f"e{tag}"),
        Op("exp", scores, name=f"e{tag}"),
    )
    return Alt(
        Op("softmax", scores, name=f"softmax{tag}"),
        Op("div", e, Op("sum", Same(f"e{tag}"), check=_LAST_KEEPDIM), name=f"softmax{tag}"),
    )


HIDDEN = -1e4  # a fill/bias at or below this hides the key (exp underflows to exactly 0)
FLOATS = (torch.float16, torch.bfloat16, torch.float32)


class Decline(Exception):
    """Raised inside the analysis: not fusable, with the reason."""


# --------------------------------------------------------------------------------------------
# Analysis helpers
# --------------------------------------------------------------------------------------------

def scalar(x: Any, ctx: MatchContext) -> Any:
    """A scalar operand as a Python number or a SymFloat/SymInt-valued node; else Decline."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return float(x)
    if isinstance(x, fx.Node):
        v = val(x)
        if isinstance(v, (int, float, torch.SymInt, torch.SymFloat)) and not isinstance(v, bool):
            return x
        if isinstance(v, torch.Tensor) and v.dim() == 0:
            # torch.full([], c) / torch.tensor(c) built in the graph from sizes and constants
            try:
                c = ctx.evaluator.evaluate(x)
            except NotStatic as exc:
                raise Decline(f"the scale '{x.name}' is a tensor computed from data ({exc})") from None
            sl = ctx.evaluator.slice(x)
            if sl.symbols:
                raise Decline(f"the scale '{x.name}' is a tensor that depends on dynamic sizes")
            return float(c)
        raise Decline(f"the scale operand '{x.name}' is not a scalar")
    raise Decline(f"the scale operand {x!r} is not a number")


def fill_hides(fill: Any, ctx: MatchContext) -> bool:
    try:
        f = scalar(fill, ctx)
    except Decline:
        return False
    return isinstance(f, float) and f <= HIDDEN


def visible(value: torch.Tensor, kind: str) -> Optional[torch.Tensor]:
    """Visible-key pattern of an evaluated mask term (None: it changes scores, not only hides)."""
    if kind == "bool_keep":
        return value.bool()
    if kind == "bool_drop":
        return ~value.bool()
    v = value.float()
    hidden = v <= HIDDEN
    if not bool(((v == 0) | hidden).all()):
        return None
    return ~hidden


def classify(vis: torch.Tensor, nq: int, nk: int) -> set:
    """The descriptions consistent with a visible-key pattern: {"none"} (all visible),
    {"top_left"} / {"bottom_right"} (causal; both when Nq == Nk, where they coincide), or
    {"general"}."""
    vis = vis.expand(*vis.shape[:-2], nq, nk) if vis.dim() >= 2 else vis.expand(nq, nk)
    flat = vis.reshape(-1, nq, nk)
    first = flat[0]
    if not bool((flat == first).all()):
        return {"general"}
    if bool(first.all()):
        return {"none"}
    i = torch.arange(nq, device=first.device)[:, None]
    j = torch.arange(nk, device=first.device)[None, :]
    out = set()
    if bool((first == (j <= i)).all()):
        out.add("top_left")
    if bool((first == (j <= i + (nk - nq))).all()):
        out.add("bottom_right")
    return out or {"general"}


# Static masks are evaluated at compile time; beyond this many elements (1 GiB of bool) a
# mask of static shape is treated as data instead, and a dynamic one is classified at the
# small probe sizes only.
MAX_STATIC_NUMEL = 1 << 30


def static_class(node: fx.Node, kind: str, scores: fx.Node, ctx: MatchContext) -> tuple[str, list[str]]:
    """Classify a static mask term by its values: at the example sizes and, under dynamic
    shapes, at probe sizes that move every size independently. Returns (class, buffers read).
    Raises NotStatic when the term depends on data or cannot be evaluated."""
    sl = ctx.evaluator.slice(node)
    sshape = shape(scores)
    classes: Optional[set] = None  # labels consistent with every size evaluated so far
    for i, assignment in enumerate(ctx.evaluator.probe_assignments(sl.symbols)):
        if ctx.evaluator.max_numel(node, assignment) > MAX_STATIC_NUMEL:
            if not sl.symbols:
                raise NotStatic(f"too large to evaluate at compile time (> {MAX_STATIC_NUMEL} elements)")
            continue
        try:
            value = torch.as_tensor(ctx.evaluator.evaluate(node, assignment or None))
            nq = int(symint_value(sshape[-2], assignment or None))
            nk = int(symint_value(sshape[-1], assignment or None))
        except NotStatic:
            raise
        except Exception as exc:
            if i == 0:  # the example sizes themselves must evaluate
                raise NotStatic(f"evaluation failed: {exc!r}") from None
            continue  # a probe size outside what the graph supports
        if value.dim() < 2:
            value = value.reshape((1,) * (2 - value.dim()) + tuple(value.shape))
        if value.shape[-2] not in (1, nq) or value.shape[-1] not in (1, nk):
            if i == 0:
                raise NotStatic(f"mask of shape {tuple(value.shape)} for {nq}x{nk} scores")
            continue
        vis = visible(value, kind)
        del value
        found = {"bias"} if vis is None else classify(vis, nq, nk)
        classes = found if classes is None else classes & found
    if classes is None:
        raise NotStatic("could not be evaluated at any size")
    for label in ("none", "top_left", "bottom_right", "bias"):
        if label in classes:  # top-left wins where every size seen had Nq == Nk
            return label, sl.buffers
    return "general", sl.buffers


def permute_last2(c: Optional[COp]) -> bool:
    if c is None or c.op != "permute":
        return False
    dims = c.attrs["dims"]
    n = len(dims)
    return n >= 2 and list(dims) == list(range(n - 2)) + [n - 1, n - 2]


def strip_scale(x: Any, view: GraphView, ctx: MatchContext, factors: list) -> Any:
    """Look through ``x * c`` / ``x / c`` / ``c * x`` with scalar c, collecting c."""
    while isinstance(x, fx.Node):
        c = view.canon(x)
        if c is None or c.op not in ("mul", "div"):
            return x
        a, b = c.args
        if c.op == "mul" and not is_tensor(b) and is_tensor(a):
            factors.append((scalar(b, ctx), 1))
            x = a
        elif c.op == "mul" and not is_tensor(a) and is_tensor(b):
            factors.append((scalar(a, ctx), 1))
            x = b
        elif c.op == "div" and not is_tensor(b) and is_tensor(a):
            factors.append((scalar(b, ctx), -1))
            x = a
        else:
            return x
    return x


def ungroup(x: Any, view: GraphView) -> tuple[Any, int]:
    """Undo a GQA head repeat of a ``[B, Hkv·g, N, D]`` operand: ``repeat_kv`` (unsqueeze,
    expand, reshape) or ``repeat_interleave(g, dim=1)``. Returns (pre-repeat tensor, g)."""
    c = view.canon(x)
    if c is None:
        return x, 1
    if c.op == "repeat_interleave" and isinstance(c.attrs["repeats"], int) and c.attrs["dim"] == 1 and ndim(x) == 4:
        return c.args[0], c.attrs["repeats"]
    if c.op == "reshape" and ndim(x) == 4:
        e = view.canon(c.args[0])
        if e is not None and e.op == "expand" and ndim(e.node) == 5:
            u = view.canon(e.args[0])
            if u is not None and u.op == "reshape" and ndim(u.node) == 5:
                src = u.args[0]
                s_src, s_u, s_e, s_out = shape(src), shape(u.node), shape(e.node), shape(x)
                if (
                    s_src is not None and len(s_src) == 4 and s_u[2] == 1
                    and tuple(s_u[:2]) == tuple(s_src[:2]) and tuple(s_u[3:]) == tuple(s_src[2:])
                    and tuple(s_e[:2]) == tuple(s_src[:2]) and tuple(s_e[3:]) == tuple(s_src[2:])
                    and s_out[1] == s_e[1] * s_e[2]
                ):
                    g = s_e[2]
                    if isinstance(g, int):
                        return src, g
    return x, 1


# --------------------------------------------------------------------------------------------
# The pattern
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Scores:
    """What :func:`analyze_scores` found in one ``softmax(scale · Q Kᵀ + masks)`` input.

    Attributes:
        node: the scores node the softmax reads (the chain's outermost node).
        qk: the ``Q Kᵀ`` node (``matmul``/``baddbmm``/``einsum``).
        rank: rank of the scores (2 to 4).
        q, k: the operands as the kernels take them (``[..., N, D]``), before any GQA undoing.
        q_t, k_t: the operand must be transposed (last two dims) at emit time.
        k_ungrouped, group: ``k`` with a GQA repeat undone and the group size (``k``, 1 if none).
        factors: the scale as ``[(value, power)]`` (value a float or a SymFloat node).
        causal: ``"none"``, ``"top_left"`` or ``"bottom_right"`` (from static masks' values).
        mask_terms: tensor mask terms the kernel must load: dicts with ``kind``, ``node``,
            ``neg``, ``shape``, ``scale``.
        buffers: module buffers the static masks were read from (assumed constant).
        in_dtype, compute_dtype: q/k dtype; dtype the scores are computed in.
        device: q's device.
        detached: a ``detach`` sits between Q Kᵀ and the softmax (no gradient flows back).
    """

    node: fx.Node
    qk: fx.Node
    rank: int
    q: Any
    k: Any
    q_t: bool
    k_t: bool
    k_ungrouped: Any
    group: int
    factors: list
    causal: str
    mask_terms: list
    buffers: list
    in_dtype: torch.dtype
    compute_dtype: torch.dtype
    device: torch.device
    detached: bool

    @property
    def mask_kind(self) -> str:
        if not self.mask_terms:
            return "none"
        return self.mask_terms[0]["kind"] if len(self.mask_terms) == 1 else "additive"

    @property
    def mask_shape(self) -> Optional[tuple]:
        if not self.mask_terms:
            return None
        return tuple(torch.broadcast_shapes(*[t["shape"] for t in self.mask_terms]))

    def dims(self) -> tuple:
        """``(Nq, Nk, D)`` (ints or SymInts)."""
        sq, sk = shape(self.q), shape(self.k)
        return (sq[-1] if self.q_t else sq[-2], sk[-1] if self.k_t else sk[-2], sq[-2] if self.q_t else sq[-1])


def analyze_scores(b: Bindings, ctx: MatchContext, tag: str = "") -> Scores:
    """Analyse the bindings of :func:`scores_rule` (``tag`` as given there): the scale, the
    masks (classified by value), the operands and their layout. Raises :class:`Decline` with
    the reason when the scores cannot be computed exactly by fuser's kernels."""
    view = ctx.view
    scores = b[f"S{tag}"]
    rank = ndim(scores)
    if rank is None:
        raise Decline("no shape information on the scores (run shape propagation first)")
    if rank < 2 or rank > 4:
        raise Decline(f"scores of rank {rank}; fuser handles 2-D to 4-D attention")
    # Scale steps on the scores, innermost first; a bias term added after `start` of them
    # is multiplied by the ones that follow it (the outer ones), so it records `start`.
    score_scales: list = []  # (value, power): Python float or SymFloat node, power ±1
    terms: list = []         # (kind, node, start, negated)
    detached = False
    qk = b[f"qk{tag}"]
    qk_c = view.canon(qk)
    if qk_c.op == "baddbmm":
        beta = qk_c.attrs["beta"]
        if beta != 0 and is_tensor(b[f"bias0{tag}"]):
            if beta != 1:
                raise Decline(f"baddbmm with beta={beta}: the bias would need rescaling")
            terms.append(("additive", b[f"bias0{tag}"], 0, False))
    for label, c, cap in reversed(b[f"steps{tag}"]):  # innermost first
        if label == "scale":
            f = scalar(cap["factor"], ctx)
            if isinstance(f, float) and f <= 0:
                raise Decline(f"the scores are multiplied by {f}; only a positive scale is fused")
            score_scales.append((f, -1 if c.op == "div" else 1))
        elif label in ("add", "sub"):
            if not is_tensor(cap["bias"]):
                continue  # a constant added to every score does not change the softmax
            terms.append(("additive", cap["bias"], len(score_scales), label == "sub"))
        elif label == "masked_fill":
            if not fill_hides(cap["fill"], ctx):
                raise Decline(f"masked_fill with value {cap['fill']!r} changes scores instead of hiding keys")
            terms.append(("bool_drop", cap["cond"], len(score_scales), False))
        elif label in ("where_keep", "where_drop"):
            if not fill_hides(cap["fill"], ctx):
                raise Decline(f"torch.where with value {cap['fill']!r} changes scores instead of hiding keys")
            terms.append(("bool_keep" if label == "where_keep" else "bool_drop", cap["cond"], len(score_scales), False))
        elif label == "cast" and c.op == "cast" and c.attrs["dtype"] not in FLOATS:
            raise Decline(f"scores cast to {c.attrs['dtype']}")
        elif label == "detach":
            detached = True
    factors = list(score_scales)
    if qk_c.op == "baddbmm" and qk_c.attrs["alpha"] != 1:
        factors.append((scalar(qk_c.attrs["alpha"], ctx), 1))

    # -- operands ---------------------------------------------------------------------
    q = strip_scale(b[f"q{tag}"], view, ctx, factors)
    kt = strip_scale(b[f"kT{tag}"], view, ctx, factors)
    q_t = bool(qk_c.attrs.get("ta"))
    if qk_c.attrs.get("tb"):
        k, k_t = kt, False
    elif permute_last2(view.canon(kt)):
        k, k_t = view.canon(kt).args[0], False
        k = strip_scale(k, view, ctx, factors)
    else:
        k, k_t = kt, True  # k = kT.transpose(-2, -1), inserted at emit
    for name, x in (("q", q), ("k", k)):
        if not is_tensor(x):
            raise Decline(f"{name} is not a tensor")
    if not (ndim(q) == ndim(k) == rank):
        raise Decline(f"q, k ranks {ndim(q)}, {ndim(k)} differ from the scores' rank {rank} (broadcast matmul)")
    k0, group = (ungroup(k, view) if rank == 4 and not k_t else (k, 1))
    # scores computed under torch.no_grad() (a frozen teacher, say): Dynamo keeps only the
    # grad-mode switches, so read it off the values; the fused op sits where grad is on again
    if ctx.grad_enabled and not val(scores).requires_grad and (val(q).requires_grad or val(k).requires_grad):
        detached = True
    if dtype(q) != dtype(k):
        raise Decline(f"q and k dtypes differ ({dtype(q)}, {dtype(k)})")
    in_dtype = dtype(q)
    if in_dtype not in FLOATS:
        raise Decline(f"dtype {in_dtype} is not supported (float16, bfloat16, float32)")
    compute_dtype = dtype(qk)
    if compute_dtype not in FLOATS:
        raise Decline(f"scores computed in {compute_dtype}")
    dev = val(q).device
    if dev.type == "cpu" and not ctx.options.interpret_cpu:
        raise Decline(ctx.options.cpu_decline)
    if dev.type not in ("cpu", "cuda"):
        raise Decline(f"device {dev.type} is not supported (cuda, or cpu through the interpreter)")
    sq, sk = shape(q), shape(k)
    d = sq[-2] if q_t else sq[-1]
    if isinstance(d, int) and not 1 <= d <= 256:
        raise Decline(f"head dim {d} is outside 1..256")
    if sq[:-2] != sk[:-2]:
        raise Decline("q and k batch dims differ (broadcasting batched matmul)")

    # -- masks ----------------------------------------------------------------------
    # Each mask term is static (evaluated here: dropped when it hides nothing, folded into
    # `causal` when causal) or a tensor the kernel loads tile by tile. Several tensor terms
    # are combined into one additive mask in the graph at emit time.
    causal, buffers, mask_terms = "none", [], []
    for kind, node, start, neg in terms:
        try:
            cls, bufs = static_class(node, kind, scores, ctx)
            buffers += bufs
        except NotStatic:
            cls = "data"
        if cls == "none":
            continue
        if cls in ("top_left", "bottom_right"):
            if causal not in ("none", cls):
                raise Decline("two causal masks with different alignments")
            causal = cls
            continue
        val_m = val(node)
        if val_m.requires_grad and ctx.grad_enabled:
            raise Decline("the additive bias requires grad; fuser's kernels do not compute dBias")
        if val_m.dim() > rank:
            raise Decline(f"mask of rank {val_m.dim()} for scores of rank {rank}")
        if kind == "additive" and val_m.dtype not in FLOATS + (torch.float64,):
            raise Decline(f"additive mask of dtype {val_m.dtype}")
        if kind != "additive" and val_m.dtype != torch.bool:
            raise Decline(f"mask condition of dtype {val_m.dtype} (expected bool)")
        mask_terms.append(dict(
            kind=kind, node=node, neg=neg, shape=tuple(val_m.shape),
            scale=score_scales[start:] if kind == "additive" else [],
        ))
    return Scores(
        node=scores, qk=qk, rank=rank, q=q, k=k, q_t=q_t, k_t=k_t, k_ungrouped=k0, group=group,
        factors=factors, causal=causal, mask_terms=mask_terms, buffers=buffers, in_dtype=in_dtype,
        compute_dtype=compute_dtype, device=dev, detached=detached,
    )


class Emitter:
    """Inserts the graph code around a fused op of a scores-based pattern (call it inside
    ``graph.inserting_before(root)``): operands brought to the kernels' 4-D ``[B, H, N, D]``
    form, the scale as a float or symbolic expression, the mask operand; every new node gets
    fake-value metadata for the passes that run after fuser.

    Args:
        graph: the graph being rewritten.
        rank: the scores' rank (2 to 4): operands of lower rank get leading unit dims.
        compute_dtype: the dtype the scores are computed in (autocast may differ from the
            operands' dtype; operands are cast to it).
    """

    def __init__(self, graph: fx.Graph, rank: int, compute_dtype: torch.dtype):
        self.graph, self.rank, self.compute_dtype = graph, rank, compute_dtype

    def node(self, kind: str, target, args, kwargs=None) -> fx.Node:
        from fuser.passes import annotate

        return annotate(self.graph.create_node(kind, target, args, kwargs or {}))

    def operand(self, x, transposed: bool, in_dtype: torch.dtype, detach: bool = False):
        """``x`` as ``[B, H, N, D]``: detached, transposed back, given leading unit dims, cast."""
        if detach:
            x = self.node("call_method", "detach", (x,))
        if transposed:
            x = self.node("call_method", "transpose", (x, -2, -1))
        for _ in range(4 - self.rank):
            x = self.node("call_method", "unsqueeze", (x, 0))
        if in_dtype != self.compute_dtype:
            x = self.node("call_method", "to", (x, self.compute_dtype))
        return x

    def unrank(self, x, lead: int = 0):
        """Drop the leading unit dims :meth:`operand` added (``lead``: dims in front of them)."""
        for _ in range(4 - self.rank):
            x = self.node("call_method", "squeeze", (x, lead))
        return x

    def scale(self, factors: list) -> object:
        """Π value**power as a Python float, or as graph nodes when some factor is symbolic."""
        total = 1.0
        symbolic = []
        for v, p in factors:
            if isinstance(v, float):
                total = total * v if p == 1 else total / v
            else:
                symbolic.append((v, p))
        out: object = total
        for v, p in symbolic:
            out = self.node("call_function", operator.mul if p == 1 else operator.truediv, (out, v))
        return out

    def mask(self, terms: list, mask_shape: Optional[tuple]) -> object:
        """The mask operand: the single mask term as it is (scaled/negated when the scores were
        scaled or subtracted after it), or several terms summed into one additive mask."""
        if not terms:
            return None
        parts = []
        for t in terms:
            x = t["node"]
            if len(terms) > 1 and t["kind"] != "additive":
                keep = x if t["kind"] == "bool_keep" else self.node("call_function", operator.invert, (x,))
                x = self.node("call_function", torch.where, (keep, 0.0, float("-inf")))
            if t["neg"]:
                x = self.node("call_function", operator.neg, (x,))
            if t["scale"]:
                x = self.node("call_function", operator.mul, (x, self.scale(t["scale"])))
            parts.append(x)
        mask = parts[0]
        for x in parts[1:]:
            mask = self.node("call_function", operator.add, (mask, x))
        for _ in range(4 - len(mask_shape)):
            mask = self.node("call_method", "unsqueeze", (mask, 0))
        return mask


def describe_mask(terms: list) -> str:
    desc = [f"{t['kind']} {t['shape']}" for t in terms]
    if not desc:
        return "none"
    if len(desc) == 1:
        return desc[0]
    return "additive, combined from " + " + ".join(desc)


def describe_scale(factors: list) -> str:
    parts = []
    total = 1.0
    symbolic = False
    for v, p in factors:
        if isinstance(v, float):
            total *= v ** p
        else:
            symbolic = True
            parts.append(f"{v.name}" if p == 1 else f"1/{v.name}")
    if not symbolic:
        return f"{total:.6g}"
    return " * ".join(([f"{total:.6g}"] if total != 1.0 else []) + parts)
