"""The KDA pattern: the Kimi Delta Attention recurrence, written as a Python loop over tokens.

KDA (Kimi Linear, Moonshot AI 2025; the gated delta rule of Yang et al., ICLR 2025, with a
per-key-channel decay) keeps a ``[K, V]`` state per head; the math is in
``patterns/kda_reference.py`` and ``docs/math.md`` ("KDA"). ``torch.compile`` unrolls the loop
into T copies of one step; this pattern finds the chain of steps and replaces it with one op
(``torch.ops.fuser.kda``, ``patterns/kda_ops.py``).

**One step** (the state ``S`` of shape ``[*L, K, V]``, ``L`` the batch and head dims), checked
by its einsum normal form (:mod:`fuser.einsum`) — so ``einsum``, broadcasting products with
``[..., None]``/``unsqueeze`` and ``.sum(-2)``, and matmuls are one spelling — with the role of
every dim named from the state's:

    D     = S ∘ exp(g_t)            g_t ``[*L, K]`` (per key channel) or ``[*L]`` (scalar gate)
    v̂     = Σ_k k_t[k] · D[k, v]     (the decayed state, contracted over k)
    S'    = D + β_t · k_t ⊗ (v_t − v̂)   (one product of three factors, in any order)
    o_t   = c · Σ_k q_t[k] · S'[k, v]  (``c`` a Python number: the scale, 1 when q is scaled before)

``q_t, k_t, v_t, g_t, β_t`` are integer selections of the time axis (``x[:, t]``,
``x[:, :, t]``, ``x.select(d, t)``; through float32 casts; a negative index counts from the end)
of tensors made before the loop: the op reads those tensors whole. **The chain**: starting where a state enters the first step
(zeros: no initial state; anything else: ``h0``), the next step is searched among the readers of
``S'`` — iteratively, so T = 1024 matches. Each step must have the same inputs, dims, scale and
gate kind as the first, with the time index one more than the last. **Outputs**: the ``o_t``
(through a cast) are written into a buffer made before the loop (``o = torch.zeros_like(v)``,
``o[:, t] = o_t``; every index of its time axis written once) or stacked (``torch.stack(outs,
d)``); the region's outputs are ``"o"`` (the buffer or the stack) and, when the program reads it,
``"state"`` (the last ``S'``).

Declined with a reason: an intermediate state read outside the chain (e.g. all states kept);
a step that differs from the first (time indices that wrap around zero, ``range(-2, T - 2)``,
too); a buffer the program did not create (an argument written in place), or not fully written
(also one whose time axis is a symbol the graph does not tie to the loop's length); float64 (the kernels compute in float32); a decay that is not
``exp`` of a selected gate; a β or gate computed inside the loop (apply it to the whole tensor
before the loop); the update reading the state before its decay. Intermediate products the
program computes in bfloat16/float16 are computed in float32 by the kernels, and the state is
carried in float32 whatever its dtype in the program (the final state is cast back). A state the
program keeps in float16/bfloat16 (rounded every step in eager) is fused only with the plans that
carry it in float32 and whose products are float32-class (recurrent, parallel, and chunk with its
default float32 dots: their results are closer to the exact one than eager's, measured in
tests/patterns/test_kda.py); the chunk plan with ``kda.dots=bfloat16`` is not offered for it.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Optional

import torch
import torch.fx as fx

from fuser.einsum import monomial
from fuser.graph import GraphView, single_int_index, annotate, dtype, location, ndim, shape, val
from fuser.names import user_name
from fuser.pattern import Candidate, Match, MatchContext, Pattern, Rejection
from fuser.static import symint_value

from . import kda_ops  # noqa: F401  (registers torch.ops.fuser.kda)
from . import kda_plans
from .masks import rounds_below

FLOATS = (torch.float16, torch.bfloat16, torch.float32)
HALF = (torch.float16, torch.bfloat16)
#: why a state the program keeps in float16/bfloat16 has fewer plans (the summary's ``state``)
HALF_STATE_NOTE = ("the chunk plan with kda.dots=bfloat16 is not offered: its bfloat16 dots would round the state "
                   "more than the program does")
INPUTS = ("q", "k", "v", "g", "beta")


class _Skip(Exception):
    """Not a KDA step at all (no reason to report)."""


class _Decline(Exception):
    """A KDA step that cannot be fused exactly: the reason."""


@dataclasses.dataclass
class Step:
    """One matched step of the chain.

    Attributes:
        s_prev, s_new: the state read and the state written (``[*L, K, V]``).
        decay: ``S ∘ exp(g_t)``; readout: the ``o_t`` node; item: what is written or stacked
            (``o_t`` or a cast of it); sink: the ``setitem`` or ``stack`` node.
        leaves: input name -> ``(base, dim, index, select node)``.
        scale: the readout's constant; scalar_gate: ``g_t`` has no key dim.
        nodes: the step's nodes (not its leaves' selections).
    """

    s_prev: fx.Node
    s_new: fx.Node
    decay: fx.Node
    readout: fx.Node
    item: fx.Node
    sink: fx.Node
    leaves: dict
    scale: float
    scalar_gate: bool
    nodes: set


def _state_roles(s: fx.Node) -> Optional[tuple]:
    sh = shape(s)
    if sh is None or len(sh) < 2:
        return None
    lead = tuple(None if isinstance(d, int) and d == 1 else f"L{i}" for i, d in enumerate(sh[:-2]))
    return lead + tuple(None if isinstance(d, int) and d == 1 else r for d, r in zip(sh[-2:], ("k", "v")))


def _time_leaf(x: fx.Node, view: GraphView, what: str) -> tuple:
    """``(base, dim, index, node)``: ``x`` selects time index ``index`` of dim ``dim`` of ``base``
    (``base[:, t]``, ``base.select(d, t)``, ``base[:, t, ..., None]``), through float32 casts."""
    if not isinstance(x, fx.Node):
        # a monomial's leaf of its own (e.g. ("exp", node): exp(beta[:, t]) computed per step)
        inner = next((a for a in (x if isinstance(x, tuple) else ()) if isinstance(a, fx.Node)), None)
        where = f" ('{inner.name}', {location(inner)})" if inner is not None else ""
        raise _Decline(f"{what}{where} is computed inside the loop from a selection; compute it for the whole "
                       "sequence before the loop")
    node = x
    while True:
        c = view.canon(x)
        if c is not None and (c.op == "identity" or (c.op == "cast" and c.attrs.get("dtype") == torch.float32)):
            x = c.args[0]
            continue
        break
    if c is not None and c.op == "select" and isinstance(c.args[0], fx.Node) and isinstance(c.attrs["index"], int):
        return c.args[0], c.attrs["dim"], c.attrs["index"], node
    if x.op == "call_function" and x.target is operator.getitem and isinstance(x.args[0], fx.Node):
        idx = x.args[1] if isinstance(x.args[1], tuple) else (x.args[1],)
        rank = ndim(x.args[0])
        picked = single_int_index(tuple(e for e in idx if e is not None), rank)
        if picked is not None:
            index = next(e for e in idx if isinstance(e, int) and not isinstance(e, bool))
            return x.args[0], picked, index, node
    sym = next((a for a in x.args if isinstance(a, fx.Node) and _symbolic_scalar(a)), None) \
        if x.op == "call_function" else None
    if sym is not None:
        raise _Decline(f"{what} ('{node.name}', {location(node)}) is scaled inside the loop by '{sym.name}', a number "
                       "computed from a symbolic size (e.g. K ** -0.5 with the head dim dynamic under dynamic=True); "
                       "the op takes a constant scale: keep the head dim static (torch.compile without dynamic=True "
                       "only marks sizes that change) or scale q for the whole sequence before the loop")
    raise _Decline(f"{what} ('{node.name}', {location(node)}) is not a selection x[:, t] of a tensor made before "
                   "the loop; compute it for the whole sequence before the loop")


def _next_time_step(before: Optional[tuple], here: Optional[tuple]) -> bool:
    """``here`` (a time leaf ``(tensor, dim, index, ...)``) reads the time step after ``before``'s
    of the same tensor and dim: the next step of one loop."""
    return (before is not None and here is not None and here[0] is before[0] and here[1] == before[1]
            and here[2] == before[2] + 1)


def _symbolic_scalar(x: fx.Node) -> bool:
    """``x`` is a Python number that depends on a symbolic size (a SymInt or SymFloat)."""
    v = x.meta.get("val", x.meta.get("example_value"))
    return isinstance(v, (torch.SymInt, torch.SymFloat))


def same_shape(a: Any, b: Any) -> bool:
    """``a == b`` for shapes that may hold SymInts (dynamic shapes): equal only when provably so,
    without adding guards."""
    if a is None or b is None:
        return False
    from ..codegen import launch

    return launch.same_sizes(a, b)


def _nn(roles: tuple) -> tuple:
    """The roles without the unit dims (None): a unit dim aligns with anything."""
    return tuple(r for r in roles if r is not None)


def _leaf_roles(m, names, leaf) -> tuple:
    for lf, roles in m.factor_roles(names):
        if lf is leaf:
            return _nn(roles)
    return ()


class KDAPattern(Pattern):
    """The unrolled KDA (gated delta rule) recurrence."""

    name = "kda"
    # dots, output_precision: the chunk plan's dots (codegen/kda_chunk.forward): dots=bfloat16 is an explicit
    # opt-in (FLA's precision class: faster, the state ~2e-3 off; never chosen by the cost model);
    # output_precision forces the input_precision of the output-path dots (default: TF32 for a bfloat16 o, else
    # the state path's, kda_chunk.resolve_output_precision); save: what the chunk plan keeps for its backward
    # (kda_ops.SAVES: the inputs, the default, or the forward's workspaces, op fuser::kda_save)
    plan_choices = {"impl": ("fuser", "inductor"), "plan": ("recurrent", "chunk", "parallel"),
                    "dots": ("float32", "bfloat16"), "output_precision": ("tf32", "tf32x3", "ieee"),
                    "save": ("inputs", "workspaces")}

    # -- anchors: where a state enters a chain ----------------------------------------------
    def anchors(self, view: GraphView):
        """The states that enter a chain: a decayed state ``S * exp(..)`` whose ``S`` is not a
        step's update; and, where a loop continues the state of another loop over other inputs
        (``s = loop(s, x1); s = loop(s, x2)``), the second loop's first decay node (its ``S`` is
        the first loop's last state, which that loop's match holds)."""
        heads = []
        for n in view.nodes:
            if view.op(n) != "mul":
                continue
            c = view.canon(n)
            for s, other in ((c.args[0], c.args[1]), (c.args[1], c.args[0])):
                if isinstance(s, fx.Node) and ndim(s) is not None and ndim(s) >= 2 and self._is_exp(other, view):
                    if not self._is_update(s, view):
                        heads.append(s)
                    elif self._continues_another_loop(n, s, view):
                        heads.append(n)
        return list(dict.fromkeys(heads))

    @staticmethod
    def _gate_leaf(decay: fx.Node, s: Any, view: GraphView) -> Optional[tuple]:
        """``(tensor, dim, time index)`` of the gate slice ``g[:, t]`` the decay ``decay = s *
        exp(g[:, t])`` reads, or None."""
        m = monomial(decay, view, is_leaf=lambda n: n is s)
        f = next((f for f in m.factors if f.is_exp), None) if m is not None else None
        if f is None or not isinstance(f.node, fx.Node):
            return None
        try:
            return _time_leaf(f.node, view, "the gate")[:3]
        except _Decline:
            return None

    def _continues_another_loop(self, decay: fx.Node, s: fx.Node, view: GraphView) -> bool:
        """``s`` (what ``decay`` decays) is the update of a step of another loop: a chain ends at
        ``s`` and a new one starts at ``decay``. Another loop does not read the next time step of
        the same gate tensor (another tensor, the time index restarting, or no time slice at all:
        a decode step) and writes its outputs elsewhere (another buffer or stack, or none); a gate
        that changes within one loop's outputs is a step that differs (a near-miss of that loop),
        not a new loop."""
        cd = view.canon(decay)
        if cd is None or cd.op != "mul" or s not in cd.args \
                or not any(self._is_exp(a, view) for a in cd.args if a is not s):
            return False
        prev = self._decayed(s, view)
        if prev is None:
            return False  # s is no step's update
        s_prev = next((a for a in view.canon(prev).args if isinstance(a, fx.Node) and not self._is_exp(a, view)), None)
        before, here = self._gate_leaf(prev, s_prev, view), self._gate_leaf(decay, s, view)
        if before is None or _next_time_step(before, here):
            return False  # the next time step of the same gate: the same loop
        roles = _state_roles(s)
        old = self._container(s, roles, view)
        s_new = next((r for r in view.readers(decay) if view.op(r) in ("add", "sub")
                      and decay in view.canon(r).args[:1 if view.op(r) == "sub" else 2]), None)
        new = self._container(s_new, roles, view) if s_new is not None else None
        return not (old is not None and old is new)

    def _container(self, s_new: fx.Node, roles: Optional[tuple], view: GraphView) -> Optional[fx.Node]:
        """Where the step that produced ``s_new`` puts its ``o_t``: the buffer it writes into or
        the stack node; None when that is not known."""
        if roles is None:
            return None
        try:
            readout = self._readout(s_new, roles, view)[0]
            _, sink = self._sink(readout, view)
        except _Decline:
            return None
        c = view.canon(sink)
        return c.args[0] if c.op == "setitem" else sink

    @staticmethod
    def _is_exp(x: Any, view: GraphView) -> bool:
        for _ in range(3):
            c = view.canon(x)
            if c is None:
                return False
            if c.op == "exp":
                return True
            if c.op not in ("reshape", "cast", "identity"):
                return False
            x = c.args[0]
        return False

    def _another_loop_follows(self, s: fx.Node, view: GraphView) -> bool:
        """A decay of ``s`` starts another loop (:meth:`_continues_another_loop`)."""
        return any(view.op(r) == "mul" and self._continues_another_loop(r, s, view) for r in view.readers(s))

    def _decayed(self, s: fx.Node, view: GraphView) -> Optional[fx.Node]:
        """``D`` where ``s`` is ``D + U`` (or ``D − U``) with ``D = S * exp(..)`` a decayed state; None
        when ``s`` is no step's update."""
        c = view.canon(s)
        if c is None or c.op not in ("add", "sub"):
            return None
        for a in (c.args if c.op == "add" else c.args[:1]):
            ca = view.canon(a)
            if ca is not None and ca.op == "mul" and any(self._is_exp(x, view) for x in ca.args):
                return a
        return None

    def _is_update(self, s: fx.Node, view: GraphView) -> bool:
        """``s`` is ``D + U`` (or ``D − U``) with ``D`` a decayed state: a step's output, not a chain's head."""
        return self._decayed(s, view) is not None

    # -- match -------------------------------------------------------------------------------
    def match(self, anchor: fx.Node, ctx: MatchContext) -> Match | Rejection | None:
        view = ctx.view
        head, first_decay = anchor, None
        if view.op(anchor) == "mul":
            # a loop that continues another loop's state (anchors): its head is that loop's last
            # state, its first step the anchor's own decay (several loops may continue one state);
            # any other anchor is a state itself (which may be a product: s = s * 2 between loops)
            prev = next((a for a in view.canon(anchor).args if isinstance(a, fx.Node)
                         and self._continues_another_loop(anchor, a, view)), None)
            if prev is not None:
                head, first_decay = prev, anchor
        roles = _state_roles(head)
        if roles is None:
            return None
        steps: list[Step] = []
        s = head
        while True:
            try:
                st = self._step(s, roles, view, decay=None if steps else first_decay)
            except _Skip:
                break
            except _Decline as exc:
                if not steps:
                    return Rejection(self.name, str(exc), location(s), anchor.name)
                if self._another_loop_follows(s, view):
                    break  # that loop's own near-miss is reported at its anchor
                return Rejection(self.name, f"step {len(steps)} of the loop differs from the others: {exc}",
                                 location(s), anchor.name)
            if st is None:
                break
            if steps and not _next_time_step(steps[-1].leaves["g"], st.leaves["g"]) \
                    and self._continues_another_loop(st.decay, s, view):
                break  # another loop, over other inputs, continues this state: a chain of its own
            steps.append(st)
            s = st.s_new
        if not steps:
            return None
        try:
            return self._chain(head, steps, roles, ctx)
        except _Decline as exc:
            return Rejection(self.name, str(exc), location(steps[0].decay), anchor.name)

    def _step(self, s_prev: fx.Node, roles: tuple, view: GraphView, decay: Optional[fx.Node] = None) -> Optional[Step]:
        """The step that decays ``s_prev`` (by ``decay`` when given: one of several readers)."""
        lead = roles[:-2]
        # D = S ∘ exp(g_t)
        only = decay
        decay = md = None
        odd_decay = None  # S * exp(<an expression>): a reason, if the rest is a delta-rule step
        for r in ([only] if only is not None else view.readers(s_prev)):
            c = view.canon(r)
            if c is None or c.op != "mul":
                continue
            m = monomial(r, view, is_leaf=lambda n: n is s_prev)
            if m is None or len(m.factors) != 2:
                continue
            if sum(f.leaf is s_prev for f in m.factors) == 1 and sum(f.is_exp for f in m.factors) == 1:
                decay, md = r, m
                break
            if odd_decay is None and any(a is s_prev for a in c.args) \
                    and any(self._is_exp(a, view) for a in c.args if a is not s_prev):
                odd_decay = r
        if decay is None and odd_decay is None:
            raise _Skip
        decay = decay or odd_decay
        # S' = D + U: the reader of D that adds it to a product (D − U: a reason)
        s_new = u = None
        subtracted = False
        for r in view.readers(decay):
            c = view.canon(r)
            if c is not None and c.op == "add" and decay in c.args:
                s_new, u = r, c.args[1] if c.args[0] is decay else c.args[0]
                break
            if c is not None and c.op == "sub" and c.args[0] is decay:
                s_new, u, subtracted = r, c.args[1], True
                break
        if s_new is None or not isinstance(u, fx.Node):
            raise _Skip
        mu = monomial(u, view, is_leaf=lambda n: n is decay)
        if mu is None or len(mu.factors) < 2 or not same_shape(shape(u), shape(s_prev)):
            raise _Skip
        # from here on it looks like a KDA step: failures have reasons
        if mu.summed:
            raise _Decline(f"the state update '{u.name}' ({location(u)}) sums over a dim of its own: one update per "
                           "chunk of tokens (a chunked form, such as FLA's naive_chunk_kda), not the token-by-token "
                           "recurrence fuser matches. Write the loop per token (S = S * g[:, t].exp()[..., None]; S = "
                           "S + β_t · k_t ⊗ (v_t − k_t · S); o[:, t] = q_t · S, as FLA's naive_recurrent_kda): fuser "
                           "then picks the chunked kernels itself where they are faster")
        if md is None:
            raise _Decline(f"the decay '{decay.name}' ({location(decay)}) multiplies the state by exp of an expression "
                           "computed inside the loop, not by exp(g_t) of a selection g[:, t]; compute the gate for "
                           "the whole sequence before the loop (e.g. g = -a, then S * g[:, t].exp())")
        if subtracted:
            raise _Decline(f"the state update '{u.name}' is subtracted from the decayed state ('{s_new.name}', "
                           f"{location(s_new)}); the delta rule adds β_t · k_t ⊗ (v_t − v̂), with v̂ = k_t · S")
        if len(mu.factors) > 3:
            raise _Decline(f"the state update '{u.name}' ({location(u)}) multiplies {len(mu.factors)} factors, not the "
                           "three of β_t · k_t ⊗ (v_t − v̂); a β computed inside the loop (e.g. β_t * β_t) is a factor "
                           "of its own: compute it for the whole sequence before the loop")
        if not same_shape(shape(s_new), shape(s_prev)) or not same_shape(shape(decay), shape(s_prev)):
            raise _Decline(f"the state changes shape in the step ('{s_new.name}'): {shape(s_prev)} -> {shape(s_new)}")
        names = md.roles({s_prev: roles}, roles)
        exp_f = next(f for f in md.factors if f.is_exp)
        g_roles = _leaf_roles(md, names, exp_f.leaf) if names else ()
        if md.const != 1.0 or md.summed or names is None or g_roles not in (_nn(roles[:-1]), _nn(lead)):
            raise _Decline(f"the decay '{decay.name}' ({location(decay)}) is not S * exp(g_t) with g_t per key "
                           "channel [..., K] or per head [...]: the gate's dims do not line up with the state's")
        scalar_gate = g_roles == _nn(lead) and g_roles != _nn(roles[:-1])
        leaves = {"g": _time_leaf(exp_f.node, view, "the gate g_t")}
        # U = β_t · k_t ⊗ (v_t − v̂)
        names_u = mu.roles({}, roles)
        if names_u is None or mu.summed or mu.const != 1.0 or len(mu.factors) != 3:
            raise _Decline(f"the state update '{u.name}' ({location(u)}) is not one product β_t · k_t ⊗ (v_t − v̂) "
                           "(write it as a single outer product; a missing β is not supported)")
        fr = dict((id(lf), r) for lf, r in mu.factor_roles(names_u))
        by_role = {}
        for f in mu.factors:
            r = _nn(fr[id(f.leaf)])
            kind = "k" if r == _nn(roles[:-1]) else "dv" if r == _nn(lead + roles[-1:]) else \
                "beta" if r == _nn(lead) else None
            if kind is None or kind in by_role:
                raise _Decline(f"the state update '{u.name}' ({location(u)}) does not have the factors β_t [...], "
                               "k_t [..., K] and (v_t − v̂) [..., V]")
            by_role[kind] = f.leaf
        if set(by_role) != {"k", "dv", "beta"}:
            raise _Decline(f"the state update '{u.name}' ({location(u)}) does not have the factors β_t, k_t, v_t − v̂")
        dv = by_role["dv"]
        cdv = view.canon(dv) if isinstance(dv, fx.Node) else None
        if cdv is None or cdv.op != "sub" or not all(isinstance(a, fx.Node) for a in cdv.args):
            raise _Decline(f"the delta '{getattr(dv, 'name', dv)}' is not v_t − v̂")
        v_t, v_hat = cdv.args
        if self._reads(v_t, decay, view) and not self._reads(v_hat, decay, view):
            raise _Decline(f"the delta '{dv.name}' ({location(dv)}) is v̂ − v_t, the opposite sign of the delta rule's "
                           "v_t − v̂ (S' = D + β_t · k_t ⊗ (v_t − v̂), with v̂ = k_t · D)")
        if ndim(v_t) != ndim(dv) or not same_shape(shape(v_hat), shape(dv)):
            raise _Decline(f"v_t and v̂ in '{dv.name}' ({location(dv)}) do not have one shape")
        leaves["k"] = _time_leaf(by_role["k"], view, "k_t")
        leaves["beta"] = _time_leaf(by_role["beta"], view, "β_t")
        leaves["v"] = _time_leaf(v_t, view, "v_t")
        # v̂ = Σ_k k_t[k] D[k, v]
        mv = monomial(v_hat, view, is_leaf=lambda n: n is decay)
        nv = mv.roles({decay: roles}, lead + roles[-1:]) if mv is not None else None
        if nv is None or len(mv.factors) != 2 or mv.const != 1.0 or not any(f.leaf is decay for f in mv.factors):
            reads_prev = mv is not None and any(f.leaf is s_prev for f in mv.factors)
            raise _Decline(f"v̂ '{v_hat.name}' ({location(v_hat)}) is not k_t · (S ∘ exp(g_t)) summed over k"
                           + (": it reads the state before its decay" if reads_prev else ""))
        kf = next(f for f in mv.factors if f.leaf is not decay)
        k_var = {v for v, r in nv.items() if r == "k"}
        if _leaf_roles(mv, nv, kf.leaf) != _nn(roles[:-1]) or set(mv.summed) != k_var:
            raise _Decline(f"v̂ '{v_hat.name}' ({location(v_hat)}) is not summed over the key dim of the state")
        if _time_leaf(kf.leaf, view, "k_t")[:3] != leaves["k"][:3]:
            raise _Decline(f"v̂ '{v_hat.name}' reads another k_t than the update")
        # o_t = c · Σ_k q_t[k] S'[k, v]: a reader of S' (through a few single-reader ops)
        readout, mo, qf = self._readout(s_new, roles, view)
        leaves["q"] = _time_leaf(qf.leaf, view, "q_t")
        item, sink = self._sink(readout, view)
        nodes = {decay, s_new, dv, v_hat, readout, item, sink} | md.nodes | mu.nodes | mv.nodes | mo.nodes
        if sink is not None and view.op(sink) == "stack":
            nodes.discard(sink)  # the stack is shared by every step: added once by the chain
        return Step(s_prev, s_new, decay, readout, item, sink, leaves, float(mo.const), scalar_gate, nodes)

    @staticmethod
    def _reads(x: Any, node: fx.Node, view: GraphView, depth: int = 6) -> bool:
        """Whether ``x`` is computed from ``node`` within ``depth`` ops (not through it)."""
        frontier = [x] if isinstance(x, fx.Node) else []
        for _ in range(depth):
            if node in frontier:
                return True
            frontier = [a for n in frontier for a in n.all_input_nodes]
        return node in frontier

    @staticmethod
    def _readout(s_new: fx.Node, roles: tuple, view: GraphView) -> tuple:
        """``(o_t node, its monomial, the q_t factor)``: the reader of ``S'`` (through a few
        single-reader ops) computing ``c · Σ_k q_t[k] S'[k, v]``; the last node of the chain that
        still does (a scale applied after the contraction belongs to it)."""
        lead = roles[:-2]

        def check(x):
            m = monomial(x, view, is_leaf=lambda n: n is s_new)
            if m is None or len(m.factors) != 2 or not any(f.leaf is s_new for f in m.factors) or not m.summed:
                return None
            names = m.roles({s_new: roles}, lead + roles[-1:])
            qf = next((f for f in m.factors if f.leaf is not s_new), None)
            k_var = {v for v, r in (names or {}).items() if r == "k"}
            if names is None or qf is None or _leaf_roles(m, names, qf.leaf) != _nn(roles[:-1]) \
                    or set(m.summed) != k_var:
                return False
            return m, qf

        why = None
        for r in view.readers(s_new):
            x = r
            for _ in range(4):
                got = check(x)
                if got:
                    m, qf = got
                    while len(view.readers(x)) == 1 and check(view.readers(x)[0]):
                        x = view.readers(x)[0]
                        m, qf = check(x)
                    return x, m, qf
                if got is False:
                    why = why or f"the read-out '{x.name}' ({location(x)}) is not q_t · S summed over the key dim"
                rd = view.readers(x)
                if len(rd) != 1:
                    break
                x = rd[0]
        raise _Decline(why or f"no read-out o_t = q_t · S summed over k reads the new state '{s_new.name}' "
                              f"({location(s_new)})")

    @staticmethod
    def _sink(readout: fx.Node, view: GraphView) -> tuple:
        """``(item, sink)``: where o_t goes (through one cast): a ``setitem`` into a buffer or a
        ``stack``."""
        item = readout
        rd = view.readers(item)
        if len(rd) == 1 and view.op(rd[0]) in ("cast", "identity"):
            item = rd[0]
            rd = view.readers(item)
        if len(rd) != 1:
            raise _Decline(f"o_t '{readout.name}' ({location(readout)}) is read {len(rd)} times; fuser takes a loop "
                           "that writes each o_t once into a buffer (o[:, t] = o_t) or stacks them")
        c = view.canon(rd[0])
        if c is not None and c.op == "setitem" and c.args[1] is item and c.args[0] is not item:
            if item is not readout and view.op(item) == "cast":
                KDAPattern._check_cast_into(readout, item, c.args[0])
            return item, rd[0]
        if c is not None and c.op == "stack":
            return item, rd[0]
        raise _Decline(f"o_t '{readout.name}' ({location(readout)}) is neither written into a buffer "
                       "(o[:, t] = o_t) nor stacked (torch.stack)")

    @staticmethod
    def _check_cast_into(readout: fx.Node, cast: fx.Node, buffer: fx.Node) -> None:
        """A cast between o_t and its write into the buffer is taken only when it changes no value
        the buffer receives: to the buffer's own dtype, or to a float at least as wide as it (the
        fused op computes o_t in float32 and rounds it once, to the buffer's dtype). A narrower cast
        (``o[:, t] = o_t.bfloat16()`` into a float32 buffer, ``.half()``, ``.int()``) rounds o_t
        first in eager, which the op would skip: declined."""
        to, into = dtype(cast), dtype(buffer)
        if not rounds_below(to, into):
            return
        raise _Decline(f"o_t '{readout.name}' ({location(readout)}) is cast to {to} before it is written into a "
                       f"{into} buffer; the fused op rounds o_t only once, to the buffer's dtype (write o_t "
                       "itself, or make the buffer that dtype)")

    # -- the chain -----------------------------------------------------------------------------
    def _chain(self, head: fx.Node, steps: list, roles: tuple, ctx: MatchContext) -> Match:
        view = ctx.view
        first = steps[0]
        def absolute(name: str, index: int) -> int:
            # x[:, t - T] is x[:, t]: a negative index counts from the end of that input's time axis
            if index >= 0:
                return index
            base, dim, _, _ = first.leaves[name]
            size = shape(base)[dim]
            if not isinstance(size, int):
                raise _Decline(f"the loop reads {name} at the negative time index {index} of a time axis of "
                               f"symbolic size {size} (dynamic shapes); index it from the start")
            return index + size

        t0 = absolute("q", first.leaves["q"][2])
        for j, st in enumerate(steps):
            for name in INPUTS:
                base, dim, index, _ = st.leaves[name]
                b0, d0, i0, _ = first.leaves[name]
                if base is not b0 or dim != d0:
                    raise _Decline(f"step {j} of the loop differs from step 0: it reads {name} from '{base.name}' dim {dim}, step 0 from '{b0.name}' dim {d0}")
                if absolute(name, index) != t0 + j:
                    if j == 0:
                        raise _Decline(f"the first step reads {name} at time index {index} and q at "
                                       f"{first.leaves['q'][2]}; one step must read every input at one time index")
                    raise _Decline(f"step {j} of the loop differs from step 0: it reads {name} at time index {index}; "
                                   f"expected {t0 + j} (the time steps must follow each other)")
            if st.scale != first.scale:
                raise _Decline(f"step {j} of the loop differs from step 0: its read-out scale is {st.scale:g}, step 0's {first.scale:g}")
            if st.scalar_gate != first.scalar_gate:
                raise _Decline(f"step {j} of the loop differs from step 0: its gate is per key channel where step 0's is per head, or the reverse")
        n_steps = len(steps)
        last = steps[-1].s_new
        for st in steps:
            for dt in (dtype(n) for n in st.nodes if n is not None):
                if dt == torch.float64:
                    raise _Decline("the loop computes in float64; fuser's KDA kernels compute in float32")
        # the inputs: whole tensors, time axis `dim`; the selections cover [t0, t0 + T)
        bases, dims = {}, {}
        for name in INPUTS:
            base, dim, _, sel = first.leaves[name]
            if dtype(base) not in FLOATS:
                raise _Decline(f"{name} ('{base.name}') is {dtype(base)}; the KDA kernels take float16, bfloat16 "
                               "and float32")
            size = symint_value(shape(base)[dim])
            if not isinstance(size, int) or size < t0 + n_steps:
                raise _Decline(f"the time axis of {name} ('{base.name}') has {size} entries, the loop reads "
                               f"{t0 + n_steps}")
            bases[name], dims[name] = base, dim
        lead = shape(last)[:-2]
        kd, vd = shape(last)[-2:]
        expect = {"q": (*lead, kd), "k": (*lead, kd), "v": (*lead, vd),
                  "g": tuple(lead) if first.scalar_gate else (*lead, kd), "beta": tuple(lead)}
        for name, want in expect.items():
            got = list(shape(bases[name]))
            del got[dims[name]]
            if name == "beta" and len(got) == len(want) + 1 and isinstance(got[-1], int) and got[-1] == 1:
                got = got[:-1]
            if not same_shape(tuple(got), tuple(want)):
                raise _Decline(f"{name} has per-step shape {tuple(got)}; the state {tuple(shape(last))} needs "
                               f"{want} (broadcast inputs are not supported)")
        # the outputs: a buffer written at every time index, or a stack
        sinks = [st.sink for st in steps]
        out_node, region_extra, out_dim = self._assembly(steps, sinks, view, t0)
        # the initial state
        ch = view.canon(head)
        h0 = None if (ch is not None and ch.op == "alloc" and ch.attrs.get("fill") == 0.0) else head
        if h0 is not None and dtype(h0) not in FLOATS:
            raise _Decline(f"the initial state '{head.name}' is {dtype(h0)}")
        region = set().union(*(st.nodes for st in steps)) | region_extra
        region.discard(None)
        if len({view.grad_enabled[n] for n in region}) > 1:
            # (attention-KL takes a no-grad teacher beside a student on purpose; one KDA op cannot)
            raise _Decline("the loop runs partly with gradients on and partly off (torch.no_grad or "
                           "set_grad_enabled inside it); the fused op would record its gradients in one mode")
        # the selections of the inputs go with the region when nothing else reads them
        for st in steps:
            for _, _, _, sel in st.leaves.values():
                if all(u in region for u in view.readers(sel)) and all(u in region for u in sel.users):
                    region.add(sel)
        outputs = {"o": out_node}
        if any(u not in region for u in list(view.readers(last)) + list(last.users)):
            outputs["state"] = last
        inputs = tuple(bases.values()) + ((h0,) if h0 is not None else ())
        bindings = dict(
            q=bases["q"], k=bases["k"], v=bases["v"], g=bases["g"], beta=bases["beta"], h0=h0,
            time_dims=tuple(dims[n] for n in INPUTS), t0=int(t0), steps=n_steps, scale=first.scale,
            scalar_gate=first.scalar_gate, out_dim=out_dim, out_dtype=dtype(out_node),
            want_state="state" in outputs, state_dtype=dtype(last),
            lead=tuple(lead), key_dim=kd, value_dim=vd, device=getattr(val(last), "device", None),
        )
        in_dtypes = sorted({str(dtype(b)).replace("torch.", "") for b in bases.values()})
        summary = {
            "q": user_name(bases["q"]), "k": user_name(bases["k"]), "v": user_name(bases["v"]),
            "g": user_name(bases["g"]), "beta": user_name(bases["beta"]),
            "steps": n_steps, "state": f"{tuple(shape(last))} {str(dtype(last)).replace('torch.', '')}"
                                       + (f" (carried in float32; {HALF_STATE_NOTE})" if dtype(last) in HALF
                                          else " (carried in float32)" if dtype(last) != torch.float32 else ""),
            "gate": "scalar per head" if first.scalar_gate else "per key channel",
            "scale": f"{first.scale:g}", "initial_state": user_name(h0) if h0 is not None else "zeros",
            "outputs": ", ".join(outputs), "dtype": "/".join(in_dtypes),
            "assembly": "index writes into a buffer" if view.op(sinks[0]) == "setitem" else "torch.stack",
        }
        return Match(self.name, out_node, frozenset(region), bindings, summary, location(first.decay),
                     ctx.graph_index, inputs=inputs, outputs=outputs)

    def _assembly(self, steps: list, sinks: list, view: GraphView, t0: int) -> tuple:
        """``(output node, extra region nodes, time dim of the output)``; ``t0``: the first time
        step the loop reads (from the start of the inputs' time axes)."""
        c0 = view.canon(sinks[0])
        n_steps = len(steps)
        if c0.op == "stack":
            if any(s is not sinks[0] for s in sinks) or list(c0.args) != [st.item for st in steps]:
                raise _Decline(f"the stack '{sinks[0].name}' does not hold exactly the loop's o_t in order")
            return sinks[0], {sinks[0]}, c0.attrs["dim"]
        buf = c0.args[0]
        cb = view.canon(buf)
        if cb is None or cb.op != "alloc":
            raise _Decline(f"the outputs are written into '{buf.name}', a tensor the program did not create with "
                           "zeros/empty; fuser's op returns a new tensor (allocate o inside the compiled function)")
        rank = ndim(buf)
        out_dim = None
        for j, (st, sk) in enumerate(zip(steps, sinks)):
            c = view.canon(sk)
            if c.op != "setitem" or c.args[0] is not buf:
                raise _Decline(f"step {j} writes its output elsewhere than '{buf.name}'")
            d = single_int_index(c.attrs["index"], rank)
            if d is None:
                raise _Decline(f"'{sk.name}' ({location(sk)}) writes o with an index other than o[:, t]")
            idx = next(e for e in c.attrs["index"] if isinstance(e, int) and not isinstance(e, bool))
            if out_dim is None:
                out_dim = d
            if idx < 0 and d == out_dim:
                if not isinstance(shape(buf)[d], int):
                    raise _Decline(f"'{sk.name}' ({location(sk)}) writes o at the negative index {idx} of a time axis "
                                   f"of symbolic size {shape(buf)[d]} (dynamic shapes)")
                idx += shape(buf)[d]
            if d != out_dim or idx != t0 + j:
                raise _Decline(f"step {j} writes o at index {idx} of dim {d}; expected {t0 + j} of dim {out_dim}")
            want = list(shape(buf))
            del want[out_dim]
            if not same_shape(tuple(shape(st.item)), tuple(want)):
                raise _Decline(f"o_t {tuple(shape(st.item))} does not fill o[:, t] {tuple(want)} (broadcast write)")
        size = shape(buf)[out_dim]
        if t0 == 0 and not isinstance(size, int) and symint_value(size) == n_steps \
                and not same_shape((size,), (n_steps,)):
            # dynamic shapes: the graph serves buffers of any length `size`, the loop fills n_steps
            raise _Decline(f"the time axis of the output buffer '{buf.name}' has the symbolic size {size}, which the "
                           f"compiled graph does not tie to the loop's {n_steps} steps (dynamic shapes: a longer "
                           "buffer keeps what the loop does not write); fuser replaces a buffer the loop fills "
                           "completely (stack the outputs, or size the buffer from the tensor the loop runs over)")
        if t0 != 0 or not same_shape((size,), (n_steps,)):
            raise _Decline(f"the loop writes {n_steps} of the {shape(buf)[out_dim]} time steps of '{buf.name}' "
                           f"(from {t0}); fuser replaces a buffer the loop fills completely")
        if dtype(buf) not in FLOATS:
            raise _Decline(f"the output buffer '{buf.name}' is {dtype(buf)}; the KDA kernels write float16, bfloat16 "
                           "or float32")
        last = max(view.order[sk] for sk in sinks)
        sink_set = set(sinks)  # (a set: T sinks, T users; a list made this quadratic)
        early = [u for u in buf.users if u not in sink_set and view.order[u] < last]
        if early:
            u = early[0]
            raise _Decline(f"'{u.name}' ({location(u)}) reads the output buffer '{buf.name}' while the loop is "
                           "still filling it; the fused op produces it whole")
        return buf, {buf}, out_dim

    # -- planning --------------------------------------------------------------------------------
    def candidates(self, m: Match, ctx: MatchContext) -> list[Candidate]:
        cands = kda_plans.candidates(m, ctx)
        if m.bindings["state_dtype"] in HALF:
            # the program rounds its state to float16/bfloat16 every step; fuser's result must be at
            # least as close to the exact one: the recurrent and parallel kernels carry the state and
            # every product in float32, the chunked kernels' default float32 dots too (tf32x3 on the
            # state path on a GPU; closer than eager, measured in tests/patterns/test_kda.py); with
            # kda.dots=bfloat16 they round the state's dot operands to bfloat16 (for float16 inputs
            # ~30x eager's error at T = 64)
            cands = [c for c in cands if c.params.get("plan") != "chunk" or c.params.get("dots") == "float32"]
        return cands

    def why_not_offered(self, m: Match, choice: str, value: str) -> str:
        why = kda_plans.why_not_offered(m, choice, value)
        if not why and m.bindings["state_dtype"] in HALF and choice == "plan" and value == "chunk":
            why = (f"the program keeps its state in {str(m.bindings['state_dtype']).replace('torch.', '')}: "
                   + HALF_STATE_NOTE)
        return why

    def kernels(self, m: Match, plan: Candidate) -> list:
        return kda_plans.kernels_for(m, plan)

    def emit(self, m: Match, plan: Candidate, graph: fx.Graph) -> dict:
        b = m.bindings
        if plan.params.get("impl") != "fuser":
            raise ValueError(f"kda plan {plan.name} emits nothing")
        with graph.inserting_before(m.insertion_point):
            target = torch.ops.fuser.kda_save.default if plan.params.get("save") == "workspaces" else \
                torch.ops.fuser.kda.default
            op = annotate(graph.call_function(target, (
                b["q"], b["k"], b["v"], b["g"], b["beta"], b["h0"], list(b["time_dims"]), b["t0"], b["steps"],
                b["scale"], b["scalar_gate"], b["out_dim"], b["out_dtype"], b["want_state"], b["state_dtype"],
                plan.params["plan_string"])))
            new = {"o": annotate(graph.call_function(operator.getitem, (op, 0)))}
            if "state" in m.outputs:
                new["state"] = annotate(graph.call_function(operator.getitem, (op, 1)))
        return new


PATTERN = KDAPattern()
