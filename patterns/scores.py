"""The scores shared by the softmax-anchored patterns: ``softmax(scale · Q Kᵀ + masks)``.

Attention, attention-KL and H2O all start from the same scores. This module holds their
spelling (rules parameterised by a tag, so one pattern can match two score chains, e.g. the
teacher's and the student's) and their analysis: the scale (numbers, symbolic sizes, tensors
built from sizes), masks proven by their values (causal top-left/bottom-right, all-visible,
general), GQA head repeats undone, operand layouts. Every decline carries its reason.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any, Optional

import sympy
import torch
import torch.fx as fx

from fuser.graph import GraphView, annotate, compose, dtype, is_tensor, ndim, permuted, shape, swap_last2, val, written_args
from fuser.matcher import HOLE, Alt, Bindings, Chain, Op, Rule, Same, Var
from fuser.pattern import MatchContext
from fuser.static import NotStatic, symint_value

from .masks import FLOATS, NEG_INF, Decline, SizeFactor, analyze_masks, round_to, rounds_below, static_product

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


def check_softmax(sm, rank: int) -> None:
    """Decline a ``softmax`` node (canonical, ``sm``) over scores of rank ``rank`` that the fused
    kernels would not reproduce: over another dim than the keys (the last), in a non-float dtype,
    or in a float dtype that rounds the scores below the dtype they are computed in
    (``softmax(s, -1, dtype=torch.bfloat16)`` of float32 scores; the kernels compute it in float32).

    Raises:
        Decline: with the reason.
    """
    if sm.attrs["dim"] != rank - 1:
        raise Decline(f"softmax over dim {sm.attrs['dim']}, not over the keys (last dim)")
    if sm.attrs["dtype"] not in (None, *FLOATS):
        raise Decline(f"softmax in {sm.attrs['dtype']}; fuser computes it in float32")
    if sm.attrs["dtype"] is not None and rounds_below(sm.attrs["dtype"], dtype(sm.args[0])):
        raise Decline(f"softmax in {sm.attrs['dtype']} of scores in {dtype(sm.args[0])}; fuser computes it "
                      "in float32")


def softmax_rule(tag: str = "", scores: Optional[Rule] = None) -> Rule:
    """A softmax over the last dim of :func:`scores_rule` (or of ``scores``, a rule that binds
    ``S<tag>``): ``softmax`` (any spelling) or by hand ``exp(S - amax(S)) / sum(...)`` (also
    without the max). Binds ``softmax<tag>``; the ``softmax`` op's dim is checked later
    (:func:`check_softmax`)."""
    scores = scores_rule(tag) if scores is None else scores
    e = Alt(
        Op("exp", Op("sub", scores, Op("amax", Same(f"S{tag}"), through={"detach"}, check=_LAST_KEEPDIM)), name=f"e{tag}"),
        Op("exp", scores, name=f"e{tag}"),
    )
    return Alt(
        Op("softmax", scores, name=f"softmax{tag}"),
        Op("div", e, Op("sum", Same(f"e{tag}"), check=_LAST_KEEPDIM), name=f"softmax{tag}"),
    )


def scalar(x: Any, ctx: MatchContext, at: Optional[fx.Node] = None) -> Any:
    """A scale operand: a Python float when its value is known at compile time (a number, or a
    0-dim tensor built in the graph from constants alone), else the node that computes it at
    run time (a symbolic size expression such as ``q.size(-2) ** -0.5``, or a 0-dim tensor
    such as a temperature buffer or parameter). Run-time factors are applied to q in the graph,
    so nothing is assumed about their value and a new length never recompiles. Raises
    Decline for anything that is not a scalar."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return float(x)
    if isinstance(x, fx.Node):
        v = val(x)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
        if isinstance(v, (torch.SymInt, torch.SymFloat)):
            return x
        if isinstance(v, torch.Tensor) and v.dim() == 0:
            if not v.is_floating_point():
                raise Decline(f"the scale '{x.name}' is a {v.dtype} tensor")
            try:
                sl = ctx.evaluator.slice(x, at)
                if not sl.symbols and not sl.buffers:
                    return float(ctx.evaluator.evaluate(x, at=at))
            except NotStatic:
                pass
            return x
        raise Decline(f"the scale operand '{x.name}' is not a scalar")
    raise Decline(f"the scale operand {x!r} is not a number")


def fill_value(fill: Any, ctx: MatchContext, at: Optional[fx.Node] = None) -> float:
    """The value a ``masked_fill``/``where`` gives hidden scores: a number known at compile
    time (finite or ``-inf``), or Decline."""
    f = scalar(fill, ctx, at)
    if not isinstance(f, float):
        raise Decline(f"the fill value '{getattr(fill, 'name', fill)}' is only known at run time")
    if f != f or f == math.inf:
        raise Decline(f"the fill value {f} gives NaN rows in eager's softmax; the kernels take a finite fill or -inf")
    return f


def strip_scale(x: Any, view: GraphView, ctx: MatchContext, factors: list) -> Any:
    """Look through ``x * c`` / ``x / c`` / ``c * x`` with scalar c, collecting c. An in-place
    ``x.mul_(c)`` is not looked through: its value is the scaled tensor itself."""
    while isinstance(x, fx.Node):
        c = view.canon(x)
        if c is None or c.op not in ("mul", "div") or written_args(x):
            return x
        a, b = c.args
        if c.op == "mul" and not is_tensor(b) and is_tensor(a):
            factors.append((scalar(b, ctx, x), 1))
            x = a
        elif c.op == "mul" and not is_tensor(a) and is_tensor(b):
            factors.append((scalar(a, ctx, x), 1))
            x = b
        elif c.op == "div" and not is_tensor(b) and is_tensor(a):
            factors.append((scalar(b, ctx, x), -1))
            x = a
        else:
            return x
    return x


def kv_heads(sc: "Scores", v: Any, v_p: Optional[tuple], view: GraphView) -> tuple[Any, Any, int]:
    """``(k, v, group)`` for the kernels: the un-repeated k (and v) and the GQA group when the
    program repeated the kv heads (``repeat_kv``, ``repeat_interleave``) — k and v alike, or k
    alone when there is no v (a score without ``P V``) — or SDPA's ``enable_gqa`` passed them
    un-repeated; else ``(sc.k, v, 1)``."""
    if sc.k_ungrouped is sc.k and sc.group > 1:  # SDPA's enable_gqa: k and v come un-repeated
        return sc.k, v, sc.group
    if sc.rank == 4 and v_p is None and sc.group > 1:
        if v is None:
            return sc.k_ungrouped, None, sc.group
        v0, gv = ungroup(v, view)
        if gv == sc.group:  # k and v repeated alike: read the un-repeated heads
            return sc.k_ungrouped, v0, gv
    return sc.k, v, 1


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
        q, k: the operands, before any GQA undoing; the kernels take ``q.permute(q_p)`` and
            ``k.permute(k_p)`` as ``[..., N, D]``.
        q_p, k_p: those permutations (None for none): ``einsum`` layouts such as
            ``"bnhd,bmhd->bhnm"``, a ``k`` given as ``Kᵀ``.
        k_ungrouped, group: ``k`` with a GQA repeat undone and the group size (``k``, 1 if none).
        factors: the scale as ``[(value, power)]``: a float known at compile time, or a node
            computed at run time (applied to q in the graph, see :meth:`Emitter.operand`).
        causal: ``"none"``, ``"top_left"`` or ``"bottom_right"`` (proven from static masks).
        causal_fill, causal_fill_mode: the score an entry above the diagonal gets
            (``-inf``: hidden, tiles skipped), and whether it replaces the score
            (``"replace"``: ``masked_fill``/``where``) or is added to it (``"add"``: an additive
            mask whose hidden entries hold that value).
        pred, pred_consts, pred_fill, pred_fill_mode: an index predicate the kernels evaluate
            per tile (``codegen/predicate.py`` form: atoms ``a·i + b·j + C[k] ≥ 0``), its
            constants ``C`` (ints or sympy expressions of the sizes), and the fill of the keys
            it hides; None when there is none.
        size_sources: symbol -> ``(node, dim)`` (``dim`` None for a size placeholder): where
            the emitter reads the sizes the predicate's constants use.
        mask_terms: tensor mask terms the kernel must load: dicts with ``kind``, ``node``,
            ``neg``, ``shape``, ``scale`` (the factors applied after it) and ``fill`` (the score a
            hidden entry of a boolean term gets, ``-inf`` when hidden).
        mask_fill: the fill of the single boolean data term (``-inf`` when there is none).
        buffers: module buffers the static masks were read from (assumed constant).
        in_dtype, compute_dtype: q/k dtype; dtype the scores are computed in.
        device: q's device.
        detached: a ``detach`` (or a no-grad block) sits between Q Kᵀ and the softmax.
    """

    node: fx.Node
    qk: fx.Node
    rank: int
    q: Any
    k: Any
    q_p: Optional[tuple]
    k_p: Optional[tuple]
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
    causal_fill: float = NEG_INF
    causal_fill_mode: str = "replace"
    mask_fill: float = NEG_INF
    pred: Any = None
    pred_consts: tuple = ()
    pred_fill: float = NEG_INF
    pred_fill_mode: str = "replace"
    size_sources: Any = None

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

    @property
    def static_scale(self) -> float:
        """The product of the scale factors known at compile time."""
        return static_product(self.factors)

    @property
    def dynamic_factors(self) -> list:
        """The scale factors computed at run time, ``[(node, power)]``."""
        return [(v, p) for v, p in self.factors if not isinstance(v, float)]

    def requires_grad(self) -> bool:
        """q, k or a run-time scale factor (a learned temperature) requires grad."""
        xs = [self.q, self.k] + [v for v, _ in self.dynamic_factors if isinstance(v, fx.Node)]
        return any(isinstance(val(x), torch.Tensor) and val(x).requires_grad for x in xs)

    @property
    def inputs(self) -> list:
        """The graph nodes the fused op reads for these scores."""
        out = [self.q, self.k, self.k_ungrouped]
        out += [v.node if isinstance(v, SizeFactor) else v for v, _ in self.dynamic_factors]
        for t in self.mask_terms:
            out.append(t["node"])
            out += [v for v, _ in t["scale"] if isinstance(v, fx.Node)]
        for c in self.pred_consts if self.pred is not None else ():
            for sym in getattr(c, "free_symbols", ()):
                out.append(self.size_sources[sym][0])
        return [x for x in out if isinstance(x, fx.Node)]

    def dims(self) -> tuple:
        """``(Nq, Nk, D)`` (ints or SymInts)."""
        sq, sk = permuted(shape(self.q), self.q_p), permuted(shape(self.k), self.k_p)
        return sq[-2], sk[-2], sq[-1]


def within(x: Any, lo: int, hi: int) -> bool:
    """``lo <= x <= hi`` for an int, or for a symbolic size: then the answer is guarded (a call
    where it no longer holds recompiles), and a size with no example value is out of range."""
    if isinstance(x, int):
        return lo <= x <= hi
    try:
        return bool(x >= lo) and bool(x <= hi)
    except Exception:  # noqa: BLE001 - e.g. an unbacked size: cannot decide, so decline
        return False


def _same_dims(a: tuple, b: tuple) -> bool:
    from ..codegen import launch

    return launch.same_sizes(a, b)


def analyze_scores(b: Bindings, ctx: MatchContext, tag: str = "", predicates: bool = False) -> Scores:
    """Analyse the bindings of :func:`scores_rule` (``tag`` as given there): the scale, the
    masks (classified by value, for every size the graph serves), the operands and their
    layout. With ``predicates``, masks built from indices that are neither causal nor empty
    become a predicate the kernels evaluate (else they are loaded as data). Raises
    :class:`Decline` with the reason when the scores cannot be computed exactly by fuser's
    kernels."""
    view = ctx.view
    scores = b[f"S{tag}"]
    rank = ndim(scores)
    if rank is None:
        raise Decline("no shape information on the scores (run shape propagation first)")
    if rank < 2 or rank > 4:
        raise Decline(f"scores of rank {rank}; fuser handles 2-D to 4-D attention")
    # Scale steps on the scores, innermost first; a mask term applied after `start` of them
    # is multiplied by the ones that follow it (the outer ones), so it records `start`.
    score_scales: list = []  # (value, power): float or run-time node, power ±1
    terms: list = []         # dicts: kind, node, start, neg, fill, dtype
    detached = False
    qk = b[f"qk{tag}"]
    qk_c = view.canon(qk)
    if qk_c.op == "baddbmm":
        beta = qk_c.attrs["beta"]
        if beta != 0 and is_tensor(b[f"bias0{tag}"]):
            if beta != 1:
                raise Decline(f"baddbmm with beta={beta}: the bias would need rescaling")
            terms.append(dict(kind="additive", node=b[f"bias0{tag}"], start=0, neg=False, fill=None, at=qk))
    # A number added to every score does not change the softmax, but a later finite fill
    # replaces only the hidden scores: the shift accumulated so far is kept, to be taken off
    # the fill ((F - shift) · later scales); None when it is not a number known at compile time.
    shift: Optional[float] = 0.0
    for label, c, cap in reversed(b[f"steps{tag}"]):  # innermost first
        if label == "scale":
            f = scalar(cap["factor"], ctx, c.node)
            score_scales.append((f, -1 if c.op == "div" else 1))
            if shift:
                shift = (shift * f if c.op != "div" else shift / f) if isinstance(f, float) else None
        elif label in ("add", "sub"):
            if not is_tensor(cap["bias"]):
                try:
                    d = scalar(cap["bias"], ctx, c.node)
                except Decline:
                    d = None
                if shift is not None and isinstance(d, float):
                    shift = shift + d if label == "add" else shift - d
                else:
                    shift = None
                continue
            terms.append(dict(kind="additive", node=cap["bias"], start=len(score_scales), neg=label == "sub", fill=None,
                              at=c.node))
        elif label == "masked_fill":
            f = round_to(fill_value(cap["fill"], ctx, c.node), dtype(c.node))
            terms.append(dict(kind="bool_drop", node=cap["cond"], start=len(score_scales), neg=False, fill=f, at=c.node,
                              shift=shift))
        elif label in ("where_keep", "where_drop"):
            f = round_to(fill_value(cap["fill"], ctx, c.node), dtype(c.node))
            terms.append(dict(kind="bool_keep" if label == "where_keep" else "bool_drop", node=cap["cond"],
                              start=len(score_scales), neg=False, fill=f, at=c.node, shift=shift))
        elif label == "cast" and c.op == "cast" and c.attrs["dtype"] not in FLOATS:
            raise Decline(f"scores cast to {c.attrs['dtype']}")
        elif label == "cast" and c.op == "cast" and rounds_below(c.attrs["dtype"], dtype(qk)):
            raise Decline(f"the scores are rounded to {c.attrs['dtype']} after Q Kᵀ in {dtype(qk)}; the fused kernels "
                          "keep them in float32 (cast the inputs instead, or keep the scores in their dtype)")
        elif label == "detach":
            detached = True
    factors = list(score_scales)
    if qk_c.op == "baddbmm" and qk_c.attrs["alpha"] != 1:
        factors.append((scalar(qk_c.attrs["alpha"], ctx, qk), 1))

    # -- operands ---------------------------------------------------------------------
    q = strip_scale(b[f"q{tag}"], view, ctx, factors)
    kt = strip_scale(b[f"kT{tag}"], view, ctx, factors)
    if qk_c.attrs.get("po") is not None:
        raise Decline("the Q Kᵀ einsum writes the scores in another layout than [..., queries, keys]")
    q_p = qk_c.attrs.get("pa")
    # the kernel's k is [..., Nk, D]: the matmul's right operand [..., D, Nk] transposed
    k_p = compose(qk_c.attrs.get("pb"), swap_last2(ndim(kt))) if ndim(kt) is not None else None
    kc = view.canon(kt)
    if kc is not None and kc.op == "permute" and not written_args(kt):
        k, k_p = kc.args[0], compose(tuple(kc.attrs["dims"]), k_p)  # look through Kᵀ = k.transpose(...)
        k = strip_scale(k, view, ctx, factors)
    else:
        k = kt
    for name, x in (("q", q), ("k", k)):
        if not is_tensor(x):
            raise Decline(f"{name} is not a tensor")
    s_scores, s_qk = shape(scores), shape(qk)
    if not _same_dims(s_scores, s_qk):
        raise Decline(
            f"a mask broadcasts the scores to {tuple(s_scores)}, beyond Q Kᵀ's {tuple(s_qk)} (e.g. a larger "
            "batch or more heads than q); the fused op computes Q Kᵀ's shape"
        )
    if not (ndim(q) == ndim(k) == rank):
        raise Decline(f"q, k ranks {ndim(q)}, {ndim(k)} differ from the scores' rank {rank} (broadcast matmul)")
    k0, group = (ungroup(k, view) if rank == 4 and k_p is None else (k, 1))
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
    # the device (CUDA, or the CPU through Triton's interpreter) is checked by the pass for every
    # pattern (fuser/passes._device_decline)
    dev = val(q).device
    sq, sk = permuted(shape(q), q_p), permuted(shape(k), k_p)
    d = sq[-1]
    if not within(d, 1, 256):
        raise Decline(f"head dim {d} is outside 1..256")
    if not _same_dims(tuple(sq[:-2]), tuple(sk[:-2])):
        raise Decline("q and k batch dims differ (broadcasting batched matmul)")

    masks = analyze_masks(terms, score_scales, tuple(shape(scores)[-2:]), rank, dtype(scores), ctx, predicates)
    return Scores(
        node=scores, qk=qk, rank=rank, q=q, k=k, q_p=q_p, k_p=k_p, k_ungrouped=k0, group=group,
        factors=factors, in_dtype=in_dtype, compute_dtype=compute_dtype, device=dev, detached=detached, **masks,
    )


def analyze_sdpa(node: fx.Node, ctx: MatchContext, predicates: bool = False) -> Scores:
    """The scores of an ``F.scaled_dot_product_attention`` call, as :func:`analyze_scores`
    gives them for a written-out softmax: ``softmax(scale · Q Kᵀ + attn_mask)`` with SDPA's
    conventions (a boolean ``attn_mask`` is True where the key is visible, ``is_causal`` is
    top-left, ``scale=None`` means ``1/sqrt(E)``, ``enable_gqa`` repeats k and v heads).
    Raises :class:`Decline` with the reason when the call cannot be computed exactly."""
    view = ctx.view
    c = view.canon(node)
    q, k, v, attn_mask = c.args
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not is_tensor(x):
            raise Decline(f"{name} is not a tensor")
    p = c.attrs["dropout_p"]
    if not (isinstance(p, (int, float)) and p == 0):
        raise Decline(f"scaled_dot_product_attention with dropout_p={p!r}; only 0 is fused")
    rank = ndim(q)
    if rank is None or not 2 <= rank <= 4 or ndim(k) != rank or ndim(v) != rank:
        raise Decline(f"scaled_dot_product_attention on ranks {ndim(q)}, {ndim(k)}, {ndim(v)}; fuser handles 2-D to 4-D")
    sq, sk = shape(q), shape(k)
    scale = c.attrs["scale"]
    if scale is None:
        e = sq[-1]
        factors = [(1.0 / math.sqrt(e), 1)] if isinstance(e, int) else [(SizeFactor(q, -1, -0.5), 1)]
    else:
        factors = [(scalar(scale, ctx, node), 1)]
    group, k0 = 1, k
    if c.attrs["enable_gqa"] is True and rank == 4:
        hq, hk = sq[1], sk[1]
        try:
            multiple = bool(hq % hk == 0)  # guarded when the head counts are symbolic
        except Exception:  # noqa: BLE001 - unbacked sizes
            multiple = False
        if not multiple:
            raise Decline("enable_gqa with query heads that are not a multiple of the key heads")
        group = int(symint_value(hq)) // int(symint_value(hk))
    elif c.attrs["enable_gqa"] not in (False, None):
        raise Decline(f"enable_gqa={c.attrs['enable_gqa']!r}")
    elif rank == 4:
        k0, group = ungroup(k, view)
    if dtype(q) != dtype(k):
        raise Decline(f"q and k dtypes differ ({dtype(q)}, {dtype(k)})")
    in_dtype = dtype(q)
    if in_dtype not in FLOATS:
        raise Decline(f"dtype {in_dtype} is not supported (float16, bfloat16, float32)")
    dev = val(q).device
    if not within(sq[-1], 1, 256):
        raise Decline(f"head dim {sq[-1]} is outside 1..256")
    if group == 1 and k0 is k and not _same_dims(tuple(sq[:-2]), tuple(sk[:-2])):
        raise Decline("q and k batch dims differ (broadcasting)")
    terms = []
    if c.attrs["is_causal"] is True:
        if attn_mask is not None:
            raise Decline("scaled_dot_product_attention with both attn_mask and is_causal")
        causal = dict(causal="top_left", causal_fill=NEG_INF, causal_fill_mode="replace", mask_terms=[],
                      mask_fill=NEG_INF, buffers=[])
    elif c.attrs["is_causal"] not in (False, None):
        raise Decline(f"is_causal={c.attrs['is_causal']!r}")
    else:
        causal = None
        if is_tensor(attn_mask):
            kind = "bool_keep" if dtype(attn_mask) == torch.bool else "additive"
            terms.append(dict(kind=kind, node=attn_mask, start=len(factors), neg=False,
                              fill=NEG_INF if kind != "additive" else None, at=node))
            out_shape = torch.broadcast_shapes(tuple(shape(attn_mask)), tuple(sq[:-1]) + (sk[-2],))
            if not _same_dims(tuple(out_shape[:-2]), tuple(sq[:-2])):
                raise Decline(f"attn_mask {tuple(shape(attn_mask))} broadcasts beyond q's batch and heads")
        elif attn_mask is not None:
            raise Decline("attn_mask is not a tensor")
    masks = causal or analyze_masks(terms, factors, (sq[-2], sk[-2]), rank, in_dtype, ctx, predicates)
    detached = bool(ctx.grad_enabled and not val(node).requires_grad
                    and (val(q).requires_grad or val(k).requires_grad))
    return Scores(
        node=node, qk=node, rank=rank, q=q, k=k, q_p=None, k_p=None, k_ungrouped=k0, group=group,
        factors=factors, in_dtype=in_dtype, compute_dtype=in_dtype, device=dev, detached=detached, **masks,
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
        return annotate(self.graph.create_node(kind, target, args, kwargs or {}))

    def operand(self, x, perm: Optional[tuple], in_dtype: torch.dtype, detach: bool = False, factors: list = ()):
        """``x`` as ``[B, H, N, D]``: permuted by ``perm`` (a view: the kernels take strides),
        given leading unit dims, cast, multiplied by the run-time scale ``factors`` (``[(node,
        power)]``: symbolic sizes or 0-dim tensors, so that no value is baked into the kernel
        and gradients reach a learned temperature), detached."""
        if perm is not None:
            x = self.node("call_method", "permute", (x, *perm))
        for _ in range(4 - self.rank):
            x = self.node("call_method", "unsqueeze", (x, 0))
        if in_dtype != self.compute_dtype:
            x = self.node("call_method", "to", (x, self.compute_dtype))
        for v, p in factors:
            x = self.node("call_function", operator.mul if p == 1 else operator.truediv, (x, self.value(v)))
        if detach:
            x = self.node("call_method", "detach", (x,))
        return x

    def unrank(self, x, lead: int = 0):
        """Drop the leading unit dims :meth:`operand` added (``lead``: dims in front of them)."""
        for _ in range(4 - self.rank):
            x = self.node("call_method", "squeeze", (x, lead))
        return x

    def scale(self, factors: list) -> float:
        """The kernel's scale: the product of the factors known at compile time (the run-time
        ones are applied to q by :meth:`operand`)."""
        return static_product(factors)

    def factor(self, factors: list) -> object:
        """Π value**power as a Python float, or as graph nodes when some factor is only known
        at run time (for mask terms the graph scales itself)."""
        out: object = static_product(factors)
        for v, p in factors:
            if not isinstance(v, float):
                out = self.node("call_function", operator.mul if p == 1 else operator.truediv, (out, self.value(v)))
        return out

    def size_expr(self, expr: Any, sources: dict) -> Any:
        """An int, or graph nodes computing ``expr`` (a sum of integer multiples of size
        symbols) from the sizes of ``sources`` (symbol -> ``(node, dim)``)."""
        if not isinstance(expr, sympy.Basic):
            return int(expr)
        total: Any = 0
        for term in sympy.Add.make_args(sympy.expand(expr)):
            coeff, rest = term.as_coeff_Mul()
            if rest == 1:
                part: Any = int(coeff)
            else:
                node, dim = sources[rest]
                size = node if dim is None else self.node("call_method", "size", (node, dim))
                part = size if coeff == 1 else self.node("call_function", operator.mul, (size, int(coeff)))
            total = part if isinstance(total, int) and total == 0 else self.node("call_function", operator.add, (total, part))
        return total

    def value(self, v: Any) -> Any:
        """A run-time factor as a graph value (a :class:`SizeFactor` is emitted here)."""
        if isinstance(v, SizeFactor):
            size = self.node("call_method", "size", (v.node, v.dim))
            return self.node("call_function", operator.pow, (size, v.power))
        return v

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
                x = self.node("call_function", operator.mul, (x, self.factor(t["scale"])))
            parts.append(x)
        mask = parts[0]
        for x in parts[1:]:
            mask = self.node("call_function", operator.add, (mask, x))
        for _ in range(4 - len(mask_shape)):
            mask = self.node("call_method", "unsqueeze", (mask, 0))
        return mask


def describe_scale(factors: list) -> str:
    """The scale as a number, times the names of the factors computed at run time."""
    total = static_product(factors)
    parts = [f"{total:.6g}"] if total != 1.0 or all(isinstance(v, float) for v, _ in factors) else []
    for v, p in factors:
        if not isinstance(v, float):
            parts.append(v.name if p == 1 else f"1/{v.name}")
    return " * ".join(parts)
