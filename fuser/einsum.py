"""Einsum normal form: what a small product-and-sum expression of the graph computes, as one
einsum over its leaves.

Patterns that recognise contractions written many ways — ``einsum('bhk,bhkv->bhv', k, S)``,
``(k[..., None] * S).sum(-2)``, ``(k.unsqueeze(-2) @ S).squeeze(-2)``, an outer product by
broadcasting ``a[..., :, None] * b[..., None, :]`` or by ``einsum('bhk,bhv->bhkv', a, b)`` — ask
:func:`monomial` for the expression's normal form instead of listing spellings:

    value[out] = const · Σ_{summed} Π_f leaf_f[vars_f]

Each dim of each leaf and of the result carries an *index variable* (an int); two dims carry the
same variable when the expression aligns them (broadcasting, an einsum letter, a matmul's inner
dim); ``None`` marks a dim of size 1 that broadcasts (a value constant along it). Summed variables
are the contracted ones. Two spellings of one contraction give the same normal form up to the
renaming of variables, so a pattern checks *roles*: :meth:`Monomial.roles` names the variables
from a factor whose dims' meaning is known (the KDA state's ``(batch..., k, v)``) or from the
result's dims, and the pattern compares the role tuples of the other factors with what the
algorithm needs.

Handled (canonical ops of :class:`fuser.graph.GraphView`): ``mul`` (broadcasting), ``div`` and
``mul`` by a Python number (into ``const``), ``neg``, unit-dim inserts (``x[..., None]``,
``unsqueeze``) and ``squeeze`` of a unit dim, ``permute``, ``expand``, ``sum`` over dims (no
``dtype``), ``einsum`` and einsum-spelled ``matmul`` (by their letters), plain ``matmul`` of
rank ≥ 2, casts to float32 and ``contiguous`` (value-preserving for the float inputs the patterns
take), and ``exp`` of a single leaf (the factor ``("exp", leaf)``). Anything else is a leaf: the
caller decides what its leaves mean (``is_leaf`` forces a node to be one).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable, Optional

import torch
import torch.fx as fx

from .graph import GraphView, ndim, shape

__all__ = ["Factor", "Monomial", "monomial"]


@dataclasses.dataclass(frozen=True)
class Factor:
    """One leaf of a monomial: ``leaf`` (an ``fx.Node``, or ``("exp", node)``) and the index
    variable of each of its dims (``None``: a size-1 dim)."""

    leaf: Any
    vars: tuple

    @property
    def node(self) -> fx.Node:
        """The graph node behind the leaf (the exponent's for ``("exp", node)``)."""
        return self.leaf[1] if isinstance(self.leaf, tuple) else self.leaf

    @property
    def is_exp(self) -> bool:
        return isinstance(self.leaf, tuple) and self.leaf[0] == "exp"


@dataclasses.dataclass(frozen=True)
class Monomial:
    """``const · Σ_{summed} Π factors``, with ``out`` the variables of the result's dims.

    Attributes:
        factors: the :class:`Factor` s, in the order the expression reads them.
        out: one variable (or None for a size-1 dim) per dim of the result.
        summed: the contracted variables.
        const: the product of the Python numbers the expression multiplies by.
        nodes: the graph nodes the expression consists of (not its leaves).
    """

    factors: tuple
    out: tuple
    summed: frozenset
    const: float
    nodes: frozenset

    def roles(self, known: dict, out_roles: Optional[tuple] = None) -> Optional[dict]:
        """Name the variables: ``known`` maps a leaf (node or ``("exp", node)``) to the role of
        each of its dims (a string, or None where the dim has size 1); ``out_roles`` names the
        result's dims. Summed variables that no known factor names get ``"Σ0"``, ``"Σ1"``, ... in
        order of appearance. Returns ``{variable: role}``, or None when two names conflict."""
        names: dict = {}

        def name(var, role) -> bool:
            if var is None:
                return role is None or not role.startswith("Σ")
            if role is None:
                return False
            if var in names:
                return names[var] == role
            if role in names.values():
                return False  # two variables, one role: the expression is not what the roles say
            names[var] = role
            return True

        for f in self.factors:
            roles = known.get(f.leaf)
            if roles is None:
                continue
            if len(roles) != len(f.vars) or not all(name(v, r) for v, r in zip(f.vars, roles)):
                return None
        if out_roles is not None:
            if len(out_roles) != len(self.out) or not all(name(v, r) for v, r in zip(self.out, out_roles)):
                return None
        sigma = itertools.count()
        for f in self.factors:
            for v in f.vars:
                if v is not None and v not in names:
                    if v not in self.summed:
                        return None  # a free variable nothing names
                    names[v] = f"Σ{next(sigma)}"
        return names

    def factor_roles(self, names: dict) -> list:
        """``[(leaf, role tuple)]`` for every factor, under ``names`` (from :meth:`roles`)."""
        return [(f.leaf, tuple(None if v is None else names.get(v) for v in f.vars)) for f in self.factors]


class _UnionFind:
    def __init__(self) -> None:
        self.parent: dict = {}
        self.counter = itertools.count()

    def new(self) -> int:
        v = next(self.counter)
        self.parent[v] = v
        return v

    def find(self, v):
        if v is None:
            return None
        while self.parent[v] != v:
            self.parent[v] = self.parent[self.parent[v]]
            v = self.parent[v]
        return v

    def union(self, a, b):
        if a is None:
            return b
        if b is None:
            return a
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[rb] = ra
        return ra


@dataclasses.dataclass
class _M:  # a monomial while it is built (variables not yet resolved)
    factors: list
    out: list
    summed: set
    const: float
    nodes: set


def _is_one(size: Any) -> bool:
    return isinstance(size, int) and size == 1


def _unit_dims_index(n: fx.Node, rank: int) -> Optional[list]:
    """For ``x[idx]`` that only inserts unit dims (``None``, ``:``, ``...``): for each output dim,
    the input dim it shows, or None for an inserted unit dim."""
    idx = n.args[1] if isinstance(n.args[1], tuple) else (n.args[1],)
    if sum(e is Ellipsis for e in idx) > 1:
        return None
    real = sum(1 for e in idx if e is not None and e is not Ellipsis)
    out, d = [], 0
    for e in idx:
        if e is None:
            out.append(None)
        elif e is Ellipsis:
            for _ in range(rank - real):
                out.append(d)
                d += 1
        elif e == slice(None):
            out.append(d)
            d += 1
        else:
            return None
    while d < rank:
        out.append(d)
        d += 1
    return out


class _Builder:
    def __init__(self, view: GraphView, is_leaf: Callable[[fx.Node], bool], max_nodes: int):
        self.view = view
        self.is_leaf = is_leaf
        self.uf = _UnionFind()
        self.budget = max_nodes

    def leaf(self, x: Any, name: Any = None) -> Optional[_M]:
        s = shape(x)
        if s is None:
            return None
        vars_ = [None if _is_one(d) else self.uf.new() for d in s]
        return _M([(name if name is not None else x, list(vars_))], list(vars_), set(), 1.0, set())

    def build(self, x: Any) -> Optional[_M]:
        if isinstance(x, (int, float)) and not isinstance(x, bool):
            return _M([], [], set(), float(x), set())
        if not isinstance(x, fx.Node):
            return None
        if self.is_leaf(x):
            return self.leaf(x)
        c = self.view.canon(x)
        if c is None or self.budget <= 0:
            return self.leaf(x)
        self.budget -= 1
        m = self._op(x, c)
        if m is None:
            return self.leaf(x)
        m.nodes.add(x)
        m.nodes.update(c.parts)
        return m

    def _broadcast(self, a: _M, b: _M) -> _M:
        r = max(len(a.out), len(b.out))
        out = []
        for i in range(r):
            ia, ib = i - (r - len(a.out)), i - (r - len(b.out))
            va = a.out[ia] if ia >= 0 else None
            vb = b.out[ib] if ib >= 0 else None
            out.append(self.uf.union(va, vb))
        return _M(a.factors + b.factors, out, a.summed | b.summed, a.const * b.const, a.nodes | b.nodes)

    def _op(self, n: fx.Node, c) -> Optional[_M]:  # noqa: C901 - a table of ops
        op = c.op
        if op == "mul":
            a, b = self.build(c.args[0]), self.build(c.args[1])
            return None if a is None or b is None else self._broadcast(a, b)
        if op == "div":
            if not isinstance(c.args[1], (int, float)) or isinstance(c.args[1], bool) or c.args[1] == 0:
                return None
            a = self.build(c.args[0])
            if a is None:
                return None
            a.const /= float(c.args[1])
            return a
        if op == "neg":
            a = self.build(c.args[0])
            if a is not None:
                a.const = -a.const
            return a
        if op in ("identity",) or (op == "cast" and c.attrs.get("dtype") == torch.float32):
            return self.build(c.args[0])
        if op == "exp":
            a = self.build(c.args[0])
            if a is None or len(a.factors) != 1 or a.summed or a.const != 1.0 or isinstance(a.factors[0][0], tuple):
                return None
            leaf, vars_ = a.factors[0]
            return _M([(("exp", leaf), vars_)], a.out, set(), 1.0, a.nodes)
        if op == "permute":
            a = self.build(c.args[0])
            dims = c.attrs.get("dims")
            if a is None or dims is None or sorted(dims) != list(range(len(a.out))):
                return None
            a.out = [a.out[d] for d in dims]
            return a
        if op == "expand":
            a = self.build(c.args[0])
            s = shape(n)
            if a is None or s is None or len(s) < len(a.out):
                return None
            a.out = [None] * (len(s) - len(a.out)) + a.out  # an expanded unit dim stays constant
            return a
        if op == "reshape":
            return self._reshape(n, c)
        if op == "sum":
            if c.attrs.get("dtype") is not None or c.attrs.get("dim") is None:
                return None
            a = self.build(c.args[0])
            if a is None:
                return None
            dims = set(c.attrs["dim"])
            if not all(isinstance(d, int) and 0 <= d < len(a.out) for d in dims):
                return None
            out = []
            for i, v in enumerate(a.out):
                if i in dims:
                    if v is not None:
                        a.summed.add(v)
                    if c.attrs.get("keepdim"):
                        out.append(None)
                else:
                    out.append(v)
            a.out = out
            return a
        if op in ("einsum", "matmul") and c.attrs.get("equation") is not None:
            *ins, lo = c.attrs["equation"]
            parts = [self.build(x) for x in c.args]
            if any(p is None for p in parts) or len(parts) != len(ins):
                return None
            letter: dict = {}
            for p, letters in zip(parts, ins):
                if len(letters) != len(p.out):
                    return None
                for ch, v in zip(letters, p.out):
                    letter[ch] = self.uf.union(letter.get(ch), v)
            m = _M([f for p in parts for f in p.factors], [letter.get(ch) for ch in lo],
                   set().union(*(p.summed for p in parts)), 1.0, set().union(*(p.nodes for p in parts)))
            for p in parts:
                m.const *= p.const
            m.summed |= {v for ch, v in letter.items() if ch not in lo and v is not None}
            return m
        if op == "matmul" and c.attrs.get("pa") is None and c.attrs.get("pb") is None and c.attrs.get("po") is None:
            a, b = self.build(c.args[0]), self.build(c.args[1])
            if a is None or b is None or len(a.out) < 2 or len(b.out) < 2:
                return None
            inner = self.uf.union(a.out[-1], b.out[-2])
            batch = self._broadcast(_M([], a.out[:-2], set(), 1.0, set()), _M([], b.out[:-2], set(), 1.0, set())).out
            m = _M(a.factors + b.factors, batch + [a.out[-2], b.out[-1]], a.summed | b.summed,
                   a.const * b.const, a.nodes | b.nodes)
            if inner is not None:
                m.summed.add(inner)
            return m
        return None

    def _reshape(self, n: fx.Node, c) -> Optional[_M]:
        x = c.args[0]
        rank = ndim(x)
        if rank is None:
            return None
        import operator

        if n.op == "call_function" and n.target is operator.getitem:
            where = _unit_dims_index(n, rank)
        else:
            name = n.target if n.op == "call_method" else getattr(n.target, "__name__", "")
            where = None
            if name == "unsqueeze":
                d = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
                if isinstance(d, int):
                    d = d + rank + 1 if d < 0 else d
                    where = list(range(rank))
                    where.insert(d, None)
            elif name == "squeeze":
                d = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
                s = shape(x)
                if isinstance(d, int) and s is not None:
                    d = d + rank if d < 0 else d
                    where = [i for i in range(rank) if i != d or not _is_one(s[d])]
        if where is None:
            return None
        a = self.build(x)
        if a is None:
            return None
        dropped = set(range(rank)) - {w for w in where if w is not None}
        if any(a.out[d] is not None for d in dropped):
            return None  # a squeeze of a dim that is not a unit dim
        a.out = [None if w is None else a.out[w] for w in where]
        return a


def monomial(node: fx.Node, view: GraphView, is_leaf: Callable[[fx.Node], bool] = lambda n: False,
             max_nodes: int = 64) -> Optional[Monomial]:
    """The einsum normal form of ``node`` (see the module docstring), looking through at most
    ``max_nodes`` ops; nodes for which ``is_leaf`` is true are leaves. None when the node has
    no known shape."""
    b = _Builder(view, is_leaf, max_nodes)
    m = b.build(node)
    if m is None:
        return None
    f = b.uf.find
    factors = tuple(Factor(leaf, tuple(f(v) for v in vars_)) for leaf, vars_ in m.factors)
    return Monomial(factors, tuple(f(v) for v in m.out), frozenset(f(v) for v in m.summed), m.const,
                    frozenset(m.nodes))
