"""A small declarative rule engine over the canonical graph view.

Rules are data, in the spirit of tinygrad's ``UPat`` and TVM Relax's dataflow patterns:

``Op({"mul", "div"}, Var("x"), Var("c"), name="scale")``
    a node whose canonical op is ``mul`` or ``div``; its operands match the sub-rules in
    order (both orders with ``commutative=True``); the node is bound as ``"scale"``.
``Var("q")``
    any operand (node or Python value), bound as ``"q"``; ``Var()`` binds nothing.
``Same("e")``
    the operand must be the node already bound as ``"e"`` (a back-reference).
``Alt(r1, r2, ...)``
    the first of the alternatives that matches (all of them, on backtracking).
``Chain(base, steps, name="steps")``
    zero or more ``steps`` applied to ``base``: each step is an ``Op`` with exactly one
    ``HOLE`` operand through which the chain continues towards ``base``; the matched steps
    are bound, outermost first, as a list of ``(label, COp, captures)`` under ``name``;
    the chain's outermost node is bound as ``root`` if given.

Every rule takes ``through={"cast", ...}``: canonical ops to look through (skip) before the
rule is tried — casts, ``contiguous``, eval-mode dropout. Every ``Op`` takes ``check``, a
predicate on its :class:`~fuser.graph.COp` that may decline. Nodes matched by ``Op`` rules
and nodes looked through form the match's *region* (the nodes a rewrite replaces); captured
operands are its inputs.

``match(rule, node, view)`` yields :class:`Bindings`; generators give backtracking for free.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator, Optional

import torch.fx as fx

from .graph import COp, GraphView


@dataclasses.dataclass(frozen=True)
class Bindings:
    """The result of a (partial) match: named captures and the region's nodes."""

    captures: tuple = ()
    region: frozenset = frozenset()

    def get(self, name: str, default: Any = None) -> Any:
        for k, v in reversed(self.captures):
            if k == name:
                return v
        return default

    def __getitem__(self, name: str) -> Any:
        sentinel = object()
        v = self.get(name, sentinel)
        if v is sentinel:
            raise KeyError(name)
        return v

    def __contains__(self, name: str) -> bool:
        return any(k == name for k, _ in self.captures)

    def bind(self, name: Optional[str], value: Any) -> "Bindings":
        if not name:
            return self
        return dataclasses.replace(self, captures=self.captures + ((name, value),))

    def add(self, *nodes: fx.Node) -> "Bindings":
        return dataclasses.replace(self, region=self.region | frozenset(nodes))

    def as_dict(self) -> dict:
        return {k: v for k, v in self.captures}


class Rule:
    """Base class of rules; see the module docstring."""

    through: frozenset = frozenset()

    def match(self, x: Any, view: GraphView, b: Bindings) -> Iterator[Bindings]:
        looked = []
        while isinstance(x, fx.Node) and self.through:
            c = view.canon(x)
            if c is None or c.op not in self.through:
                break
            looked.append(x)
            x = c.args[0]
        if looked:
            b = b.add(*looked)
        yield from self._match(x, view, b)

    def _match(self, x: Any, view: GraphView, b: Bindings) -> Iterator[Bindings]:
        raise NotImplementedError


class _Hole(Rule):
    def _match(self, x, view, b):  # pragma: no cover - replaced during Chain matching
        raise RuntimeError("HOLE outside a Chain step")

    def __repr__(self) -> str:
        return "HOLE"


HOLE = _Hole()


class Var(Rule):
    """Any operand (node or Python value); bound under ``name`` if given."""

    def __init__(self, name: Optional[str] = None, *, through: set = frozenset(), check: Optional[Callable[[Any], bool]] = None):
        self.name = name
        self.through = frozenset(through)
        self.check = check

    def _match(self, x, view, b):
        if self.check is not None and not self.check(x):
            return
        yield b.bind(self.name, x)

    def __repr__(self) -> str:
        return f"Var({self.name!r})"


class Same(Rule):
    """The node already bound as ``name``."""

    def __init__(self, name: str, *, through: set = frozenset()):
        self.name = name
        self.through = frozenset(through)

    def _match(self, x, view, b):
        if self.name in b and b[self.name] is x:
            yield b


class Op(Rule):
    """A node whose canonical op is one of ``ops``, with operands matching ``src``.

    Args:
        ops: canonical op name(s) accepted (an alternation set).
        *src: operand rules, positional over the canonical operands; with no ``src`` the
            operands are not looked at. Extra canonical operands beyond ``src`` are ignored.
        name: bind the node under this name.
        through: canonical ops to look through before this rule.
        commutative: for two operands, also try them swapped.
        check: ``check(cop) -> bool``; False declines.
        label: the step's label when used as a ``Chain`` step.
    """

    def __init__(
        self,
        ops: str | set,
        *src: Rule,
        name: Optional[str] = None,
        through: set = frozenset(),
        commutative: bool = False,
        check: Optional[Callable[[COp], bool]] = None,
        label: Optional[str] = None,
    ):
        self.ops = frozenset({ops} if isinstance(ops, str) else ops)
        self.src = src
        self.name = name
        self.through = frozenset(through)
        self.commutative = commutative
        self.check = check
        self.label = label

    def _match(self, x, view, b, hole: Optional[Callable] = None):
        if not isinstance(x, fx.Node) or x in b.region:
            return
        c = view.canon(x)
        if c is None or c.op not in self.ops:
            return
        if self.check is not None and not self.check(c):
            return
        b = b.add(x, *c.parts).bind(self.name, x)
        if not self.src:
            yield b
            return
        if len(c.args) < len(self.src):
            return
        orders = [tuple(range(len(self.src)))]
        if self.commutative and len(self.src) == 2:
            orders.append((1, 0))
        for order in orders:
            pairs = [(self.src[i], c.args[order[i]]) for i in range(len(self.src))]
            # a Chain step's HOLE continues the chain: match it last, once the step's own
            # operands are bound
            pairs.sort(key=lambda rp: rp[0] is HOLE)
            yield from self._operands(pairs, 0, view, b, hole)

    def _operands(self, pairs: list, i: int, view, b, hole):
        if i == len(pairs):
            yield b
            return
        rule, arg = pairs[i]
        if rule is HOLE:
            assert hole is not None, "HOLE outside a Chain step"
            it = hole(arg, b)
        else:
            it = rule.match(arg, view, b)
        for b2 in it:
            yield from self._operands(pairs, i + 1, view, b2, hole)

    def __repr__(self) -> str:
        return f"Op({sorted(self.ops)}, {', '.join(map(repr, self.src))})"


class Alt(Rule):
    """The alternatives in order."""

    def __init__(self, *rules: Rule, through: set = frozenset()):
        self.rules = rules
        self.through = frozenset(through)

    def _match(self, x, view, b):
        for r in self.rules:
            yield from r.match(x, view, b)


class Chain(Rule):
    """Zero or more ``steps`` wrapped around ``base`` (see the module docstring)."""

    def __init__(self, base: Rule, steps: tuple, *, name: str, root: Optional[str] = None, max_steps: int = 16,
                 through: set = frozenset()):
        for s in steps:
            if sum(r is HOLE for r in s.src) != 1:
                raise ValueError(f"a Chain step needs exactly one HOLE operand: {s!r}")
        self.base = base
        self.steps = steps
        self.name = name
        self.root = root
        self.max_steps = max_steps
        self.through = frozenset(through)

    def _match(self, x, view, b):
        yield from self._walk(x, view, b.bind(self.root, x), [], 0)

    def _walk(self, x, view, b, taken, depth):
        for done in self.base.match(x, view, b):
            yield done.bind(self.name, list(taken))
        if depth >= self.max_steps:
            return
        for step in self.steps:
            before = len(b.captures)

            def hole(arg, b_step, step=step, before=before):
                c = view.canon(x)
                local = dict(b_step.captures[before:])
                # the step's own captures are recorded with it and removed from the flat list
                b_clean = dataclasses.replace(b_step, captures=b_step.captures[:before])
                yield from self._walk(arg, view, b_clean, taken + [(step.label, c, local)], depth + 1)

            yield from step._match(x, view, b, hole=hole)


def match(rule: Rule, node: fx.Node, view: GraphView) -> Iterator[Bindings]:
    """All matches of ``rule`` rooted at ``node``."""
    yield from rule.match(node, view, Bindings())
