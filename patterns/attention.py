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

from fuser.graph import COp, GraphView, dtype, is_tensor, location, ndim, shape, val
from fuser.matcher import HOLE, Alt, Chain, Op, Same, Var, match
from fuser.pattern import Candidate, Match, MatchContext, Pattern, Rejection
from fuser.static import NotStatic

from . import attention_ops  # noqa: F401  (registers torch.ops.fuser.attention and its backward)
from .attention_reference import CAUSAL_MODES, MASK_KINDS, causal_offset, reference  # noqa: F401

# --------------------------------------------------------------------------------------------
# Spelling: rules as data (see fuser/matcher.py)
# --------------------------------------------------------------------------------------------

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
)
QK = Alt(
    Op("matmul", Var("q"), Var("kT"), name="qk"),
    Op("baddbmm", Var("bias0"), Var("q"), Var("kT"), name="qk"),
)
SCORES = Chain(QK, SCORE_STEPS, name="steps", root="S")
_EXP = Alt(
    Op("exp", Op("sub", SCORES, Op("amax", Same("S"), through={"detach"}, check=_LAST_KEEPDIM)), name="e"),
    Op("exp", SCORES, name="e"),
)
SOFTMAX = Alt(
    Op("softmax", SCORES, name="softmax"),
    Op("div", _EXP, Op("sum", Same("e"), check=_LAST_KEEPDIM), name="softmax"),
)
# Between P and the P V matmul: casts, contiguous, dropout (checked: eval or p = 0).
P_THROUGH = frozenset({"cast", "identity", "dropout"})

_HIDDEN = -1e4  # a fill/bias at or below this hides the key (exp underflows to exactly 0)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


class Decline(Exception):
    """Raised inside the analysis: not fusable, with the reason."""


# --------------------------------------------------------------------------------------------
# Analysis helpers
# --------------------------------------------------------------------------------------------

def _scalar(x: Any, ctx: MatchContext) -> Any:
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


def _fill_hides(fill: Any, ctx: MatchContext) -> bool:
    try:
        f = _scalar(fill, ctx)
    except Decline:
        return False
    return isinstance(f, float) and f <= _HIDDEN


def _visible(value: torch.Tensor, kind: str) -> Optional[torch.Tensor]:
    """Visible-key pattern of an evaluated mask term (None: it changes scores, not only hides)."""
    if kind == "bool_keep":
        return value.bool()
    if kind == "bool_drop":
        return ~value.bool()
    v = value.float()
    hidden = v <= _HIDDEN
    if not bool(((v == 0) | hidden).all()):
        return None
    return ~hidden


def _classify(vis: torch.Tensor, nq: int, nk: int) -> set:
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


def _static_class(node: fx.Node, kind: str, scores: fx.Node, ctx: MatchContext) -> tuple[str, list[str]]:
    """Classify a static mask term by its values: at the example sizes and, under dynamic
    shapes, at probe sizes that move every size independently. Returns (class, buffers read).
    Raises NotStatic when the term depends on data or cannot be evaluated."""
    from fuser.static import symint_value

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
        vis = _visible(value, kind)
        del value
        found = {"bias"} if vis is None else _classify(vis, nq, nk)
        classes = found if classes is None else classes & found
    if classes is None:
        raise NotStatic("could not be evaluated at any size")
    for label in ("none", "top_left", "bottom_right", "bias"):
        if label in classes:  # top-left wins where every size seen had Nq == Nk
            return label, sl.buffers
    return "general", sl.buffers


def _permute_last2(c: Optional[COp]) -> bool:
    if c is None or c.op != "permute":
        return False
    dims = c.attrs["dims"]
    n = len(dims)
    return n >= 2 and list(dims) == list(range(n - 2)) + [n - 1, n - 2]


def _strip_scale(x: Any, view: GraphView, ctx: MatchContext, factors: list) -> Any:
    """Look through ``x * c`` / ``x / c`` / ``c * x`` with scalar c, collecting c."""
    while isinstance(x, fx.Node):
        c = view.canon(x)
        if c is None or c.op not in ("mul", "div"):
            return x
        a, b = c.args
        if c.op == "mul" and not is_tensor(b) and is_tensor(a):
            factors.append((_scalar(b, ctx), 1))
            x = a
        elif c.op == "mul" and not is_tensor(a) and is_tensor(b):
            factors.append((_scalar(a, ctx), 1))
            x = b
        elif c.op == "div" and not is_tensor(b) and is_tensor(a):
            factors.append((_scalar(b, ctx), -1))
            x = a
        else:
            return x
    return x


def _ungroup(x: Any, view: GraphView) -> tuple[Any, int]:
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

class AttentionPattern(Pattern):
    """Scaled dot-product attention with optional causal/padding/bias masks and GQA."""

    name = "attention"

    def anchors(self, view: GraphView):
        for n in view.graph.nodes:
            op = view.op(n)
            if op == "softmax" or op == "div":
                yield n

    # -- match ---------------------------------------------------------------------------
    def match(self, anchor: fx.Node, ctx: MatchContext) -> Match | Rejection | None:
        view = ctx.view
        first_decline: Optional[Rejection] = None
        for b in match(SOFTMAX, anchor, view):
            consumer = self._consumer(anchor, view)
            if consumer is None:
                return None  # a softmax that does not feed P V: not attention (maybe H2O, KL)
            if isinstance(consumer, str):
                return Rejection(self.name, consumer, location(anchor), anchor.name)
            pv, p_nodes = consumer
            try:
                return self._analyze(b, anchor, pv, p_nodes, ctx)
            except Decline as exc:
                first_decline = first_decline or Rejection(self.name, str(exc), location(anchor), anchor.name)
        return first_decline

    def _consumer(self, p: fx.Node, view: GraphView):
        """Follow P through casts/dropout to the P V matmul: (pv node, nodes passed), None if
        P feeds no matmul as its left operand, or a reason string if P is also used elsewhere."""
        passed = []
        x = p
        while True:
            readers = view.readers(x)
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
            if c is not None and c.op in P_THROUGH and c.args[0] is x:
                passed.append(r)
                x = r
                continue
            if c is not None and c.op == "matmul" and c.args[0] is x and not c.attrs.get("ta"):
                return r, passed
            return None

    def _analyze(self, b, anchor: fx.Node, pv: fx.Node, p_nodes: list, ctx: MatchContext) -> Match:
        view = ctx.view
        sm = view.canon(anchor)
        scores = b["S"]
        rank = ndim(scores)
        if rank is None:
            raise Decline("no shape information on the scores (run shape propagation first)")
        if rank < 2 or rank > 4:
            raise Decline(f"scores of rank {rank}; fuser handles 2-D to 4-D attention")
        if sm.op == "softmax":
            if sm.attrs["dim"] != rank - 1:
                raise Decline(f"softmax over dim {sm.attrs['dim']}, not over the keys (last dim)")
            if sm.attrs["dtype"] not in (None, *_FLOATS):
                raise Decline(f"softmax in {sm.attrs['dtype']}; fuser computes it in float32")
        for n in p_nodes:
            c = view.canon(n)
            if c.op == "dropout":
                p, training = c.attrs["p"], c.attrs["training"]
                if training is not False and p != 0:
                    raise Decline(f"dropout on the attention weights is active (p={p}, training); not fused")
            if c.op == "cast" and c.attrs["dtype"] not in _FLOATS:
                raise Decline(f"P is cast to {c.attrs['dtype']}")

        # Scale steps on the scores, innermost first; a bias term added after `start` of them
        # is multiplied by the ones that follow it (the outer ones), so it records `start`.
        score_scales: list = []  # (value, power): Python float or SymFloat node, power ±1
        terms: list = []         # (kind, node, start, negated)
        qk = b["qk"]
        qk_c = view.canon(qk)
        if qk_c.op == "baddbmm":
            beta = qk_c.attrs["beta"]
            if beta != 0 and is_tensor(b["bias0"]):
                if beta != 1:
                    raise Decline(f"baddbmm with beta={beta}: the bias would need rescaling")
                terms.append(("additive", b["bias0"], 0, False))
        for label, c, cap in reversed(b["steps"]):  # innermost first
            if label == "scale":
                f = _scalar(cap["factor"], ctx)
                if isinstance(f, float) and f <= 0:
                    raise Decline(f"the scores are multiplied by {f}; only a positive scale is fused")
                score_scales.append((f, -1 if c.op == "div" else 1))
            elif label in ("add", "sub"):
                if not is_tensor(cap["bias"]):
                    continue  # a constant added to every score does not change the softmax
                terms.append(("additive", cap["bias"], len(score_scales), label == "sub"))
            elif label == "masked_fill":
                if not _fill_hides(cap["fill"], ctx):
                    raise Decline(f"masked_fill with value {cap['fill']!r} changes scores instead of hiding keys")
                terms.append(("bool_drop", cap["cond"], len(score_scales), False))
            elif label in ("where_keep", "where_drop"):
                if not _fill_hides(cap["fill"], ctx):
                    raise Decline(f"torch.where with value {cap['fill']!r} changes scores instead of hiding keys")
                terms.append(("bool_keep" if label == "where_keep" else "bool_drop", cap["cond"], len(score_scales), False))
            elif label == "cast" and c.op == "cast" and c.attrs["dtype"] not in _FLOATS:
                raise Decline(f"scores cast to {c.attrs['dtype']}")
        factors = list(score_scales)
        if qk_c.op == "baddbmm" and qk_c.attrs["alpha"] != 1:
            factors.append((_scalar(qk_c.attrs["alpha"], ctx), 1))

        # -- operands ---------------------------------------------------------------------
        q = _strip_scale(b["q"], view, ctx, factors)
        kt = _strip_scale(b["kT"], view, ctx, factors)
        q_t = bool(qk_c.attrs.get("ta"))
        if qk_c.attrs.get("tb"):
            k, k_t = kt, False
        elif _permute_last2(view.canon(kt)):
            k, k_t = view.canon(kt).args[0], False
            k = _strip_scale(k, view, ctx, factors)
        else:
            k, k_t = kt, True  # k = kT.transpose(-2, -1), inserted at emit
        pv_c = view.canon(pv)
        v = pv_c.args[1]
        v_t = bool(pv_c.attrs.get("tb"))
        for name, x in (("q", q), ("k", k), ("v", v)):
            if not is_tensor(x):
                raise Decline(f"{name} is not a tensor")
        if not (ndim(q) == ndim(k) == ndim(v) == rank):
            raise Decline(f"q, k, v ranks {ndim(q)}, {ndim(k)}, {ndim(v)} differ from the scores' rank {rank} (broadcast matmul)")
        group = 1
        if rank == 4 and not k_t and not v_t:
            k0, gk = _ungroup(k, view)
            v0, gv = _ungroup(v, view)
            if gk == gv and gk > 1:
                k, v, group = k0, v0, gk
        dts = {dtype(q), dtype(k), dtype(v)}
        if len(dts) != 1:
            raise Decline(f"q, k, v dtypes differ ({dtype(q)}, {dtype(k)}, {dtype(v)})")
        in_dtype = dts.pop()
        if in_dtype not in _FLOATS:
            raise Decline(f"dtype {in_dtype} is not supported (float16, bfloat16, float32)")
        compute_dtype = dtype(qk)
        if compute_dtype not in _FLOATS:
            raise Decline(f"scores computed in {compute_dtype}")
        out_dtype = dtype(pv)
        dev = val(q).device
        if dev.type == "cpu" and ctx.options.interpret == "off":
            raise Decline("tensors are on the CPU and the Triton interpreter is off (fuser.interpret=False)")
        if dev.type not in ("cpu", "cuda"):
            raise Decline(f"device {dev.type} is not supported (cuda, or cpu through the interpreter)")
        sq, sk, sv = shape(q), shape(k), shape(v)
        d = sq[-2] if q_t else sq[-1]
        dv = sv[-2] if v_t else sv[-1]
        for nm, x in (("head dim", d), ("value head dim", dv)):
            if isinstance(x, int) and not 1 <= x <= 256:
                raise Decline(f"{nm} {x} is outside 1..256")
        if sq[:-2] != sk[:-2] and group == 1:
            raise Decline("q and k batch dims differ (broadcasting batched matmul)")
        if sk[:-2] != sv[:-2]:
            raise Decline("k and v batch dims differ (broadcasting batched matmul)")

        # -- masks ----------------------------------------------------------------------
        # Each mask term is static (evaluated here: dropped when it hides nothing, folded into
        # `causal` when causal) or a tensor the kernel loads tile by tile. Several tensor terms
        # are combined into one additive mask in the graph at emit time.
        causal, buffers, mask_terms = "none", [], []
        for kind, node, start, neg in terms:
            try:
                cls, bufs = _static_class(node, kind, scores, ctx)
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
            if kind == "additive" and val_m.dtype not in _FLOATS + (torch.float64,):
                raise Decline(f"additive mask of dtype {val_m.dtype}")
            if kind != "additive" and val_m.dtype != torch.bool:
                raise Decline(f"mask condition of dtype {val_m.dtype} (expected bool)")
            mask_terms.append(dict(
                kind=kind, node=node, neg=neg, shape=tuple(val_m.shape),
                scale=score_scales[start:] if kind == "additive" else [],
            ))
        if not mask_terms:
            mask_kind, mask_shape = "none", None
        elif len(mask_terms) == 1:
            mask_kind, mask_shape = mask_terms[0]["kind"], mask_terms[0]["shape"]
        else:
            mask_kind = "additive"
            mask_shape = tuple(torch.broadcast_shapes(*[t["shape"] for t in mask_terms]))

        need_lse = bool(ctx.grad_enabled and any(val(x).requires_grad for x in (q, k, v)))
        region = frozenset(b.region) | frozenset(p_nodes) | {pv}
        bindings = dict(
            q=q, k=k, v=v, q_t=q_t, k_t=k_t, v_t=v_t, factors=factors, causal=causal, mask_terms=mask_terms,
            mask_kind=mask_kind, mask_shape=mask_shape, group=group, rank=rank,
            in_dtype=in_dtype, compute_dtype=compute_dtype, out_dtype=out_dtype, need_lse=need_lse,
            device=dev,
        )
        summary = {
            "q": q.name, "k": k.name, "v": v.name,
            "scale": _describe_scale(factors),
            "causal": causal,
            "mask": _describe_mask(mask_terms),
            "gqa_group": group,
            "dtype": str(in_dtype).replace("torch.", ""),
            "shape": f"q{tuple(sq)} k{tuple(sk)} v{tuple(sv)}",
            "softmax": "hand-written" if sm.op == "div" else "softmax",
            "training": need_lse,
        }
        if buffers:
            summary["assumes_constant"] = sorted(set(buffers))
        return Match(self.name, pv, region, bindings, summary, location(anchor), ctx.graph_index)

    # -- planning ------------------------------------------------------------------------
    def candidates(self, m: Match, ctx: MatchContext) -> list[Candidate]:
        from fuser.patterns.attention_plans import candidates

        return candidates(m, ctx)

    def kernels(self, m: Match, plan: Candidate) -> list:
        from fuser.codegen import attention as kernels

        if plan.params.get("impl") != "fuser":
            return []
        b = m.bindings
        ms = b["mask_shape"]
        row_bcast = ms is not None and (len(ms) < 2 or ms[-2] == 1)
        mode = plan.params.get("backward", "two_kernel")
        out = []
        for bwd_mode in (("two_kernel", "atomic_dq") if mode == "autotune" else (mode,)):
            for k in kernels.kernels_for(
                causal=b["causal"], mask_kind=b["mask_kind"], mask_row_broadcast=bool(row_bcast),
                bwd_mode=bwd_mode, interpret=b["device"].type == "cpu",
                need_lse=b["need_lse"], training=b["need_lse"],
            ):
                if k not in out:
                    out.append(k)
        return out

    # -- emission --------------------------------------------------------------------------
    def emit(self, m: Match, plan: Candidate, graph: fx.Graph) -> fx.Node:
        from fuser.patterns.attention_plans import emit

        return emit(m, plan, graph)


def _describe_mask(terms: list) -> str:
    desc = [f"{t['kind']} {t['shape']}" for t in terms]
    if not desc:
        return "none"
    if len(desc) == 1:
        return desc[0]
    return "additive, combined from " + " + ".join(desc)


def _describe_scale(factors: list) -> str:
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


PATTERN = AttentionPattern()
